"""The demo's last lines say its summary in words (a newcomer saw Python dicts:
`microbatches {'issued': 160, ...}`, `outer steps {'rounds': 16, ...}`)."""

from noloco_node.cli.demo_report import report_lines

SWARM = {
    "mode": "swarm",
    "method": "noloco",
    "replicas": 2,
    "stages": 2,
    "inner_steps": 40,
    "wall_s": 47.6,
    "tokens_per_s": 1391.2,
    "loss_first": 7.9031,
    "loss_last": 5.8712,
    "microbatches": {"issued": 1600, "completed": 1598, "reissued": 3, "dropped": 2},
    "outer": {"rounds": 16, "paired": 14, "solo": 2, "rejected": 1, "timed_out": 2, "mixed_rounds": 0},
    "replica_spread_last": 0.0012041,
}


def test_a_swarm_demo_reads_as_words_with_every_count():
    assert report_lines(SWARM) == [
        "swarm demo, method noloco: 2 replicas x 2 stages, 40 inner steps in 48 s, 1,391 tok/s",
        "train loss 7.903 -> 5.871",
        "microbatches: 1,600 issued, 1,598 completed, 3 re-issued, 2 dropped",
        "outer rounds: 16, 14 paired and 2 solo (1 partner snapshot refused, 2 exchanges failed); "
        "replica spread 1.204e-03",
    ]
    assert not any("{" in line for line in report_lines(SWARM))


def test_a_clean_noloco_run_names_no_failures_and_one_replica_has_no_spread():
    summary = {**SWARM, "replicas": 1, "stages": 1, "replica_spread_last": None}
    summary["outer"] = {"rounds": 4, "paired": 0, "solo": 4, "rejected": 0, "timed_out": 0}
    lines = report_lines(summary)
    assert lines[0].startswith("swarm demo, method noloco: 1 replica x 1 stage, ")
    assert (
        lines[-1]
        == "outer rounds: 4, 0 paired and 4 solo; replica spread n/a (fewer than 2 replicas saved their weights)"
    )


def test_diloco_counts_rounds_not_pairs_and_a_run_without_outer_steps_says_nothing_of_them():
    diloco = {**SWARM, "method": "diloco", "outer": {"rounds": 8, "paired": 0, "solo": 0, "partial_rounds": 1}}
    assert report_lines(diloco)[-1] == ("outer rounds: 8, 1 delivered part of the mean only; replica spread 1.204e-03")
    plain = {**SWARM, "method": "none", "outer": {"rounds": 0}, "microbatches": None}
    assert len(report_lines(plain)) == 2


def test_the_model_lines_name_the_program_as_the_user_typed_it():
    summary = {**SWARM, "model": "runs/demo/model", "config_file": "runs/demo/config.toml"}
    lines = report_lines(summary, ".venv/bin/noloco-node")
    assert lines[-2:] == [
        '  try: .venv/bin/noloco-node generate runs/demo/model --prompt "And God said"',
        "       .venv/bin/noloco-node eval --config runs/demo/config.toml runs/demo/model",
    ]
