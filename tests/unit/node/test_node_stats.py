"""The stats file's shape: `NodeStats.to_dict()` is a file format experiments and tests read, so
a renamed field must not rename a key."""

import json

from noloco_node.runtime.node_stats import RoundBytes

from .stats_sample import sample_stats

TOP_KEYS = [
    "peer_id",
    "stage",
    "address",
    "inner_steps",
    "last_lr",
    "sequences",
    "tokens",
    "forwards_received",
    "forwards_sent",
    "backwards_sent",
    "send_failures",
    "dropped_here",
    "expired",
    "busy_answers",
    "routed",
    "routed_to",
    "routed_by_capacity",
    "routed_expected",
    "throughput",
    "bytes_sent",
    "rejected",
    "saved_inputs",
    "bans",
    "in_flight",
    "bytes_received",
    "tokens_per_s",
    "attention",
    "admission",
    "transport",
    "integrity",
    "routing_bans",
    "faults_fired",
]
OUTER_KEYS = [
    "outer",
    "outer_history",
    "bytes_sent_outer",
    "bytes_received_outer",
    "outer_bytes_per_round",
    "outer_round",
    "fetched_state",
]
NODE_KEYS = ["resumed_from", "movable", "moves"]
DRIVER_KEYS = ["microbatches", "losses", "lrs", "step_times", "step_losses", "reissued_sequences", "schedule"]


def test_the_stats_file_keeps_its_keys_and_their_order():
    out = sample_stats(stage=0, driver=True, outer=True).to_dict()
    assert list(out) == TOP_KEYS + OUTER_KEYS + NODE_KEYS + DRIVER_KEYS
    assert list(out["admission"]) == [
        "swarm_key",
        "refused",
        "peers_banned",
        "banned_now",
        "rate_limited",
        "over_stream_cap",
        "refused_banned",
        "tracked_peers",
    ]
    assert list(out["transport"]) == [
        "reach",
        "p2p_addrs",
        "bytes_by_path",
        "impostor_records",
        "impostor_calls",
        "replayed_tokens",
        "cut_at_receive_deadline",
        "libp2p_streams",
        "relay_served",
    ]
    assert list(out["integrity"]) == ["skipped_steps", "weights_repaired", "dropped_non_finite", "payloads_refused"]
    assert list(out["outer"]) == [
        "rounds",
        "paired",
        "solo",
        "rejected",
        "timed_out",
        "skipped",
        "resynced",
        "mixed_rounds",
        "partial_rounds",
    ]
    assert list(out["microbatches"]) == ["issued", "completed", "reissued", "dropped"]
    assert out["schedule"] == {"overlap": False, "stale_microbatches": 0, "max_staleness": 0}
    assert out["transport"]["libp2p_streams"] == {"in": 1, "out": 2, "refused_in": 0}


def test_the_stats_file_keeps_its_values():
    out = sample_stats().to_dict()
    assert out["routed"] == {"balanced": 4, "random": 1} and out["routed_to"] == {"n": 5}
    assert out["forwards_received"] == {"p": 3, "q": 4} and out["bytes_sent"] == 1000
    assert out["bytes_sent_outer"] == 500 and out["outer"]["paired"] == 1 and out["outer_round"] == 2
    assert out["outer_bytes_per_round"] == {"last": 400, "mean": 400.0, "fp32_fraction": 0.5}
    assert out["microbatches"]["dropped"] == 1 and out["step_losses"] == [7.5, 6.25]
    assert out["admission"]["refused"] == {"UNAUTHENTICATED": 2} and out["integrity"]["payloads_refused"] == 1
    assert json.loads(json.dumps(out)) == out  # plain JSON, as the file is written


def test_parts_a_node_lacks_leave_their_keys_out():
    out = sample_stats(stage=1, driver=False, outer=False).to_dict()
    assert list(out) == TOP_KEYS + NODE_KEYS
    restarted = sample_stats(driver=False, inherited_microbatches={"issued": 4, "completed": 4}).to_dict()
    assert restarted["microbatches"] == {"issued": 4, "completed": 4} and "losses" not in restarted


def test_typed_reads_spare_the_readers_the_keys():
    stats = sample_stats()
    assert stats.loss == 8.0 and stats.bytes_sent == 1500 and stats.microbatches_completed == 15
    assert stats.work.served == 7 and stats.outer.last_round["outcome"] == "solo"
    assert sample_stats(driver=False, outer=False).loss is None
    assert RoundBytes.of([]) == RoundBytes(last=0, mean=0.0, fp32_fraction=0.0)
    history = [{"bytes": {"phi": 3, "delta": 4}}, {"outcome": "solo"}, {"bytes": {"phi": 5, "delta": 1}}, {}]
    assert RoundBytes.last_of(history) == RoundBytes.of(history).last == 6 and RoundBytes.last_of([]) == 0


def test_a_stage_0_whose_recopy_landed_at_its_last_step_keeps_its_predecessors_microbatches():
    """test_chaos once saw a driver copy its stage's state at step 55 of 60 and land at 60: no
    driver, no checkpoint resumed, and the stats lost the microbatch accounting."""
    from types import SimpleNamespace

    from noloco_node.node.stats import _inherited_microbatches

    counts = {"issued": 110, "completed": 108, "reissued": 3, "dropped": 2}
    moved = SimpleNamespace(
        driver=None, stage_index=0, resumed_from=None, moves=[{"why": "behind", "microbatches": counts}]
    )
    assert _inherited_microbatches(moved) == counts
    resumed = SimpleNamespace(driver=None, stage_index=0, resumed_from={"microbatches": {"issued": 4}}, moves=[])
    assert _inherited_microbatches(resumed) == {"issued": 4}
    assert _inherited_microbatches(SimpleNamespace(driver=None, stage_index=1, resumed_from=None, moves=[])) is None
