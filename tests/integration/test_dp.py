"""Data-parallel baseline in the swarm: gradients all-reduced every inner step keep the replicas
of every stage on identical weights, and every stage steps exactly once per batch (lockstep, as
the reference's DP baseline), also the stages past 0 that only see the microbatches routed to them."""

import itertools

import pytest
import torch
from safetensors.torch import load_file

from noloco_node.runtime.events import read_events

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_dp_two_replicas_stay_identical(tmp_path, make_swarm):
    steps = 6
    # 3 microbatches per driver per batch: a per-sender random cycle over 2 replicas cannot split
    # that evenly, so only a balanced routing keeps every stage-1 replica at one batch per step.
    batch, seq_len = 6, 16
    # Lockstep: a stage's gradient goes upstream only after its all-reduce, which under load can
    # take longer than the tiny default re-issue deadline (5 s); a re-issue would then be
    # computed twice by stage 1, so the microbatch deadline covers a slow round.
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "dp",
            "inner.total_steps": steps,
            "outer.allreduce_group_size": 2,
            "timeouts.match_s": 3.0,
            "pipeline.batch_size": batch,
            "model.seq_len": seq_len,
            "timeouts.microbatch_s": 30.0,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    events = tmp_path / "events"
    servers = [
        swarm.start_node(1, r, "--save-weights", "--events", str(events / f"stage1-r{r}.jsonl")) for r in range(2)
    ]
    swarm.wait_ready(servers)
    drivers = [
        swarm.start_node(0, r, "--steps", str(steps), "--wait-replicas", "2", "--save-weights") for r in range(2)
    ]
    swarm.wait_exit(drivers, timeout_s=240)
    assert all(d.proc.returncode == 0 for d in drivers)
    swarm.stop()

    stats = swarm.node_stats()
    for stage in (0, 1):
        peers = [p for p, s in stats.items() if s["stage"] == stage]
        assert len(peers) == 2
        assert [stats[p]["inner_steps"] for p in peers] == [steps, steps], f"stage {stage}"
        history = [stats[p]["outer_history"] for p in peers]
        assert all(len(h) == steps for h in history), f"stage {stage}: {history}"
        assert all(r["same_round"] for h in history for r in h), f"stage {stage}: {history}"
        # A round is a full group of both replicas, or one the node reports as not full: hivemind
        # can deliver part of a mean (a result stream ended early; it only logs that), and then
        # its partner's matchmaking can end without a group (it steps on its own gradient). Both
        # are counted in the node's stats, and then the replicas may differ. Rare on loopback.
        full = [r for h in history for r in h if r["group"] == 2 and r["complete"]]
        partial = [r for h in history for r in h if not r["complete"]]
        solo = [r for h in history for r in h if r["group"] != 2]
        assert all(r["outcome"] == "solo" and r["group"] == 1 for r in solo), f"stage {stage}: {history}"
        assert len(full) + len(partial) + len(solo) == 2 * steps, f"stage {stage}: {history}"
        assert sum(stats[p]["outer"]["partial_rounds"] for p in peers) == len(partial)
        assert sum(stats[p]["outer"]["solo"] for p in peers) == len(solo)
        assert len(full) >= 2 * steps - 2, f"stage {stage}: more than one round failed: {history}"
        weights = [
            load_file(str(next((swarm.out_dir / "nodes").glob(f"stage{stage}-{p[-8:]}.safetensors")))) for p in peers
        ]
        if partial or solo:
            print(f"stage {stage}: {len(partial)} partial and {len(solo)} failed all-reduce round(s) reported")
            continue
        # Every round complete: bit-identical replicas (gradients are averaged in float64, so
        # every member rounds the same mean to float32).
        for a, b in itertools.combinations(weights, 2):
            for name in a:
                assert torch.equal(a[name], b[name]), (
                    f"stage {stage} {name}: max diff {(a[name] - b[name]).abs().max()}"
                )
    # Lockstep: stage 1 takes step k having processed exactly k batches (its share of the D
    # batches), never a microbatch of batch k+1 computed with the weights from before step k.
    for r in range(2):
        tokens = [
            (e["inner_step"], e["tokens"])
            for e in read_events(events / f"stage1-r{r}.jsonl")
            if e["event"] == "inner_step"
        ]
        assert tokens == [(k, k * batch * seq_len) for k in range(1, steps + 1)], f"stage1 r{r}: {tokens}"
    stage0 = [p for p, s in stats.items() if s["stage"] == 0]
    assert all(stats[p]["routed"] == {"balanced": steps * batch // 2, "random": 0} for p in stage0), stats
    losses = stats[stage0[0]]["losses"]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3  # it trained, not just averaged
