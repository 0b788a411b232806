"""`noloco-node plan` (fewest stages that fit, and what each needs), its link model (model/costs.py)
and `config show`'s resolved model."""

import json
import math

import pytest

from noloco_node.cli.main import main
from noloco_node.cli.plan import find_plan
from noloco_node.config import load_config
from noloco_node.model.build import resolve_llama_config, run_model
from noloco_node.model.costs import CALL_OVERHEAD_BYTES, OPTIONS, Link, choose, pipeline_costs, predict

GIB = 1 << 30


def _plan(capsys, *args) -> tuple[int, dict]:
    code = main(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("memory_gib", [24, 80])
def test_plan_answers_for_large_with_the_fewest_stages_that_fit(capsys, memory_gib):
    code, report = _plan(capsys, "--preset", "large", "--memory-gib", str(memory_gib))
    assert code == 0 and report["fits"] and report["model"]["num_layers"] == 32
    stages = report["num_stages"]
    assert len(report["stages"]) == stages
    assert all(s["bytes"]["total"] <= 0.9 * memory_gib * GIB for s in report["stages"])
    covered = [layer for s in report["stages"] for layer in range(s["layers"][0], s["layers"][1] + 1)]
    assert covered == list(range(32))
    # no fewer stages fit with any of the settings plan tries
    cfg = load_config(overrides=["model.preset=large"])
    llama = resolve_llama_config(cfg.model, cfg.data.vocab_size)
    assert find_plan(cfg, llama, 0.9 * memory_gib * GIB, "cuda", max_stages=stages - 1) is None


def test_more_memory_needs_fewer_stages(capsys):
    small_card = _plan(capsys, "--preset", "large", "--memory-gib", "24")[1]["num_stages"]
    big_card = _plan(capsys, "--preset", "large", "--memory-gib", "80")[1]["num_stages"]
    assert big_card < small_card


def test_plan_turns_on_checkpointing_before_it_adds_a_stage(capsys):
    from noloco_node.cli.plan import Settings, with_settings
    from noloco_node.model.memory import estimate_for_run

    sets = ["model.preset=medium", "model.seq_len=2048", "pipeline.batch_size=16", "pipeline.microbatch_size=4"]
    cfg = load_config(overrides=sets)
    llama = resolve_llama_config(cfg.model, cfg.data.vocab_size)
    need = {}
    for checkpointing in (False, True):
        one = with_settings(cfg, 1, Settings(checkpointing, "exact", 8))
        need[checkpointing] = estimate_for_run(one, llama, [range(24)], 0, "cuda").total
    assert need[True] < need[False]
    between = (need[True] + need[False]) / 2 / 0.9 / GIB  # one stage fits only with checkpointing
    code, report = _plan(capsys, *[a for s in sets for a in ("--set", s)], "--memory-gib", f"{between:.3f}")
    assert code == 0 and report["num_stages"] == 1 and report["settings"]["pipeline.activation_checkpointing"] is True
    code, report = _plan(
        capsys, *[a for s in sets for a in ("--set", s)], "--memory-gib", f"{need[False] / 0.9 / GIB + 1:.3f}"
    )
    assert report["num_stages"] == 1 and report["settings"]["pipeline.activation_checkpointing"] is False


def test_plan_says_when_nothing_fits_and_needs_a_speed_for_a_link(capsys):
    code, report = _plan(capsys, "--preset", "large", "--memory-gib", "1")
    assert code == 1 and not report["fits"] and "seq_len" in report["problem"]
    assert main(["plan", "--preset", "tiny", "--memory-gib", "8", "--link", "100"]) == 2
    assert "--device-tflops" in capsys.readouterr().err


def test_plan_with_a_link_predicts_the_ratio_per_schedule(capsys):
    code, report = _plan(
        capsys, "--preset", "medium", "--memory-gib", "80", "--link", "100", "--rtt", "30", "--gpu", "h100"
    )
    assert code == 0
    link = report["link"]
    for key in ("exact/outer_blocking", "exact/outer_overlap", "overlap/outer_blocking", "overlap/outer_overlap"):
        assert 0 < link[key]["ratio"] < 1
    assert link["exact/outer_overlap"]["ratio"] >= link["exact/outer_blocking"]["ratio"]


def test_the_printed_plan_marks_the_one_row_its_settings_run(capsys):
    """A newcomer saw two rows marked as the plan's (both outer modes of its pipeline schedule)."""
    from noloco_node.cli.main import main

    argv = ["plan", "--preset", "medium", "--memory-gib", "80", "--link", "100", "--rtt", "30", "--gpu", "h100"]
    for overlap, row in (("true", "outer_overlap"), ("false", "outer_blocking")):
        assert main([*argv, "--set", f"outer.overlap={overlap}"]) == 0
        marked = [line for line in capsys.readouterr().out.splitlines() if "<- the plan's settings" in line]
        assert len(marked) == 1 and marked[0].split()[0].endswith("/" + row), marked


# ---- the link model -------------------------------------------------------------------------------
def _costs(**settings):
    cfg = load_config(overrides=["model.preset=medium", "pipeline.num_stages=2", "model.seq_len=1024"])
    config, ranges = run_model(cfg, 4096)
    base = dict(microbatch=4, seq_len=1024, microbatches_per_batch=4, max_in_flight=8, inner_steps_per_outer=50)
    base.update(settings)
    return pipeline_costs(config, ranges, **base)


@pytest.mark.parametrize("schedule", ["exact", "overlap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_an_unlimited_link_loses_nothing(schedule, overlap):
    pred = predict(_costs(schedule=schedule, outer_overlap=overlap), tflops=989, link=Link(math.inf, 0.0))
    assert pred.ratio == 1.0 and pred.step_s == pred.step_unlimited_s and pred.outer_s == 0.0


@pytest.mark.parametrize("schedule", ["exact", "overlap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_ratio_falls_as_the_link_slows_and_the_rtt_grows(schedule, overlap):
    costs = _costs(schedule=schedule, outer_overlap=overlap)
    ratios = [predict(costs, tflops=989, link=Link(mbit, 20)).ratio for mbit in (1e6, 1e4, 1e3, 100, 10)]
    assert all(a >= b for a, b in zip(ratios, ratios[1:])) and ratios[0] > 0.9 > 0.1 > ratios[-1]
    rtts = [predict(costs, tflops=989, link=Link(1000, rtt)).ratio for rtt in (0, 10, 100, 1000)]
    assert all(a >= b for a, b in zip(rtts, rtts[1:])) and rtts[0] > rtts[-1]


def test_an_overlapped_outer_exchange_never_predicts_less_than_a_blocking_one():
    for codec in ("bf16", "int8", "int4"):
        for mbit in (1e5, 1000, 100, 10, 1):
            for rtt in (0, 50):
                for schedule in ("exact", "overlap"):
                    kwargs = dict(schedule=schedule, activation_codec=codec)
                    blocking = predict(_costs(outer_overlap=False, **kwargs), tflops=989, link=Link(mbit, rtt))
                    overlapped = predict(_costs(outer_overlap=True, **kwargs), tflops=989, link=Link(mbit, rtt))
                    assert overlapped.ratio >= blocking.ratio, (codec, mbit, rtt, schedule)


def test_fewer_bytes_per_hop_predict_more_and_the_figures_add_up():
    bf16, int4 = (predict(_costs(activation_codec=c), tflops=989, link=Link(100, 30)) for c in ("bf16", "int4"))
    assert int4.ratio > bf16.ratio
    # medium, microbatch 4 x 1024 tokens: 8.4 M activation values, 16.8 MB in bf16 (issue 26's figure)
    assert bf16.extra["hop_bytes"] == 4 * 1024 * 2048 * 2
    labels = 4 * 1024 * 2  # every forward carries the next-token labels: 2-byte varints at vocabulary 4096
    assert bf16.uplink_s[0] == pytest.approx((4 * 1024 * 2048 * 2 + CALL_OVERHEAD_BYTES + labels) * 8 / 100e6)
    assert bf16.outer_s == pytest.approx(bf16.extra["outer_bytes_per_stage"] * 8 / 100e6 + 0.06)


def _hop_link(costs, compute_s: float, hop_ratio: float, rtt_ms: float = 0.0, shared: bool = True) -> Link:
    """The link on which one bf16 hop takes hop_ratio x `compute_s` (the benchmark's profiles)."""
    return Link(costs.hop_elements * 2.0 / (hop_ratio * compute_s) * 8 / 1e6, rtt_ms, shared)


def test_measured_compute_and_the_fill_and_drain_arithmetic():
    # P = 2, M = 4, each stage 0.1 s per microbatch, a hop 4x that (the benchmark's home profile)
    costs = _costs(microbatches_per_batch=4, inner_steps_per_outer=6)
    c, link = 0.1, _hop_link(costs, 0.1, 4.0, rtt_ms=30)
    pred = predict(costs, stage_seconds=(c, c), link=link)
    # the bf16 payload and the call's own bytes; a forward also carries its labels
    x_fwd = 4 * c * (1 + (CALL_OVERHEAD_BYTES + costs.forward_extra_bytes) / (costs.hop_elements * 2.0))
    x_bwd = 4 * c * (1 + CALL_OVERHEAD_BYTES / (costs.hop_elements * 2.0))
    assert costs.forward_extra_bytes == costs.hop_elements / 2048 * 2
    assert pred.compute_s == (c, c) and pred.uplink_s == pytest.approx((x_fwd, x_bwd))
    assert pred.step_unlimited_s == pytest.approx(2 * c + 3 * c)  # L + (M - 1) tau, nothing on the wire
    assert pred.step_s == pytest.approx(2 * c + x_fwd + x_bwd + 0.03 + 3 * x_fwd)  # the link is the interval
    with pytest.raises(ValueError, match="one compute time"):
        predict(costs, stage_seconds=(c,), link=link)


def test_a_round_overhead_counts_in_both_runs_and_hides_behind_an_overlapped_exchange():
    costs, c = _costs(microbatches_per_batch=4, inner_steps_per_outer=6), 0.1
    link = _hop_link(costs, c, 0.4)
    plain = predict(costs, stage_seconds=(c, c), link=link)
    overhead = predict(costs, stage_seconds=(c, c), link=link, round_overhead_s=1.0)
    h = costs.inner_steps_per_outer
    assert overhead.round_s == pytest.approx(plain.round_s + 1.0)
    assert overhead.ratio == pytest.approx((h * plain.step_unlimited_s + 1.0) / (plain.round_s + 1.0))
    assert overhead.ratio > plain.ratio  # the same fixed cost on both links narrows the gap
    assert predict(costs, stage_seconds=(c, c), link=Link(), round_overhead_s=1.0).ratio == 1.0
    overlapped = predict(
        _costs(microbatches_per_batch=4, inner_steps_per_outer=50, outer_overlap=True),
        stage_seconds=(c, c),
        link=link,
        round_overhead_s=1.0,
    )
    assert overlapped.outer_s + 1.0 < 50 * overlapped.step_s
    assert overlapped.round_s == pytest.approx(50 * overlapped.step_s)  # 1 s + the exchange fit in H steps


def test_per_connection_links_never_predict_less_than_a_shared_uplink():
    for stages, overlap in ((2, False), (3, True), (3, False)):
        cfg = load_config(overrides=["model.preset=small", f"pipeline.num_stages={stages}", "model.seq_len=1024"])
        config, ranges = run_model(cfg, 4096)
        costs = pipeline_costs(
            config,
            ranges,
            microbatch=4,
            seq_len=1024,
            microbatches_per_batch=4,
            max_in_flight=8,
            inner_steps_per_outer=50,
            outer_overlap=overlap,
        )
        for mbit in (10, 100, 1000):
            shared = predict(costs, tflops=200, link=Link(mbit, 20, shared=True))
            apart = predict(costs, tflops=200, link=Link(mbit, 20, shared=False))
            assert apart.ratio >= shared.ratio, (stages, overlap, mbit)
            if stages == 3:  # a middle node's activations and gradients no longer share its uplink
                assert apart.uplink_s[1] < shared.uplink_s[1]


def test_choose_needs_fewer_changes_on_faster_links():
    def costs_for(option):
        return _costs(
            activation_codec=option.activation_codec,
            gradient_codec=option.gradient_codec,
            outer_payload=(option.outer_codec,),
            outer_overlap=option.outer_overlap,
            schedule=option.schedule,
        )

    picks = []
    for mbit in (10, 100, 1000, 10_000, 1e6):
        pick, rows = choose(costs_for, link=Link(mbit, 20), tflops=200)
        assert [o for o, _, _ in rows] == list(OPTIONS)
        relative = [r for _, _, r in rows]
        assert pick == next((i for i, r in enumerate(relative) if r >= 0.9), relative.index(max(relative)))
        picks.append(pick)
    assert picks == sorted(picks, reverse=True) and picks[-1] == 0 and picks[0] > 0, picks
    assert choose(costs_for, link=Link(), tflops=200)[0] == 0  # unlimited: keep the defaults


def test_config_show_prints_the_model_the_run_trains_and_its_split(capsys):
    assert main(["config", "show", "--set", "model.preset=small", "--set", "pipeline.num_stages=3"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["model"]["hidden_size"], shown["model"]["num_layers"], shown["model"]["num_heads"]) == (768, 12, 12)
    assert shown["model"]["intermediate_size"] == 3072 and shown["model_resolved"]["vocab_size"] == 4096
    stages = shown["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2] and sum(s["num_layers"] for s in stages) == 12
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 11
    assert sum(s["parameters"] for s in stages) == shown["model_resolved"]["parameters"]


def test_an_asymmetric_line_is_limited_by_its_slower_side():
    costs = _costs(activation_codec="int4", gradient_codec="int4", outer_overlap=True)
    speed = dict(tflops=165, mfu=0.3)
    up20 = predict(costs, link=Link(20, 40), **speed).ratio
    # a faster downlink does not help a node whose sends are the bottleneck; a slower one hurts
    assert predict(costs, link=Link(20, 40, downlink_mbit=100), **speed).ratio == pytest.approx(up20)
    assert (
        predict(costs, link=Link(100, 40, downlink_mbit=20), **speed).ratio
        < predict(costs, link=Link(100, 40), **speed).ratio
    )


def test_plan_prices_a_residual_subspace_on_an_asymmetric_line(capsys):
    sets = [
        "model.seq_len=1024",
        "pipeline.batch_size=16",
        "pipeline.microbatch_size=2",
        "outer.inner_steps_per_outer=100",
        "pipeline.activation_codec=int4",
        "pipeline.gradient_codec=int4",
        "outer.codec_delta=int8",
    ]
    args = [a for s in sets for a in ("--set", s)]
    code, report = _plan(
        capsys,
        "--preset",
        "medium",
        "--memory-gib",
        "24",
        "--uplink",
        "20",
        "--downlink",
        "100",
        "--rtt",
        "40",
        "--device-tflops",
        "165",
        *args,
    )
    assert code == 0 and report["link"]["downlink_mbit"] == 100
    rows = report["link"]["subspace"]["options"]
    assert [r["rank"] for r in rows] == [0, 256, 128, 64, 32]
    hops = [r["hop_bytes"] for r in rows]
    assert hops == sorted(hops, reverse=True) and hops[3] < hops[0] / 16  # k = d/32: under a sixteenth of dense
    assert all(b["ratio"] >= a["ratio"] for a, b in zip(rows, rows[1:]))  # fewer bytes never predict less
    assert all(r["frozen_table_bytes"] == 4 * 4096 * 2048 + 8 * 2048 * r["rank"] for r in rows[1:])
    for bad in (["--link", "100", "--uplink", "20"], ["--downlink", "100"], ["--uplink", "0"]):
        assert main(["plan", "--preset", "tiny", "--memory-gib", "8", "--gpu", "h100", *bad]) == 2
        assert "--" in capsys.readouterr().err


def test_plan_recommends_no_rank_for_a_model_narrower_than_the_price_was_measured_at(capsys):
    code, report = _plan(capsys, "--preset", "tiny", "--memory-gib", "8", "--uplink", "20", "--gpu", "h100")
    assert code == 0 and report["link"]["subspace"]["recommended"] is None
    assert all(r["time_to_dense_loss_vs_dense"] is None for r in report["link"]["subspace"]["options"][1:])


def test_plan_gives_the_outer_rounds_bytes_and_whether_it_hides_for_each_codec(capsys):
    """medium on a 24 GB card at 20 Mbit/s up, H = 100: the dense round (a quarter of fp32 phi +
    Delta) does not hide behind H steps, the compressed one (slice:0.01 + topk:0.02+int2) does,
    and its bytes are the codecs' share of the stage's fp32 phi + Delta."""
    sets = [
        "model.seq_len=1024",
        "pipeline.batch_size=16",
        "pipeline.microbatch_size=2",
        "outer.inner_steps_per_outer=100",
        "pipeline.activation_codec=int4",
        "model.residual_subspace=128",
    ]
    args = [a for s in sets for a in ("--set", s)]
    code, report = _plan(
        capsys,
        "--preset",
        "medium",
        "--memory-gib",
        "24",
        "--uplink",
        "20",
        "--downlink",
        "100",
        "--rtt",
        "40",
        "--device-tflops",
        "165",
        *args,
    )
    assert code == 0
    rows = {tuple(r["codecs"]): r for r in report["link"]["outer_round"]["options"]}
    dense, small = rows[("bf16",)], rows[("slice:0.01", "topk:0.02+int2")]
    assert dense["configured"] and not small["configured"]
    assert dense["fp32_fraction"] == 0.25 and 0.009 < small["fp32_fraction"] < 0.011
    assert dense["bytes_each_way"] / small["bytes_each_way"] == pytest.approx(
        dense["fp32_fraction"] / small["fp32_fraction"]
    )
    assert not dense["hidden"] and small["hidden"] and small["exchange_s"] < dense["exchange_s"] / 20
    assert small["ratio"] > dense["ratio"]
