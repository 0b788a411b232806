"""Data-parallel baseline in the swarm: gradients all-reduced every inner step keep the replicas
of a stage on identical weights."""

import itertools

import pytest
import torch
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_dp_two_replicas_stay_identical(tmp_path, make_swarm):
    steps = 6
    overrides = tiny_overrides(tmp_path, **{"outer.method": "dp", "inner.total_steps": steps, "outer.allreduce_group_size": 2, "timeouts.match_s": 1.5})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    servers = [swarm.start_node(1, r, "--save-weights") for r in range(2)]
    swarm.wait_ready(servers)
    drivers = [swarm.start_node(0, r, "--steps", str(steps), "--wait-replicas", "2", "--save-weights") for r in range(2)]
    swarm.wait_exit(drivers, timeout_s=240)
    assert all(d.proc.returncode == 0 for d in drivers)
    swarm.stop()

    stats = swarm.node_stats()
    stage0 = [p for p, s in stats.items() if s["stage"] == 0]
    history = [stats[p]["outer_history"] for p in stage0]
    assert all(len(h) == steps for h in history)
    assert all(r["group"] == 2 and r["same_round"] for h in history for r in h), history
    weights = [load_file(str(next((swarm.out_dir / "nodes").glob(f"stage0-{p[-8:]}.safetensors")))) for p in stage0]
    for a, b in itertools.combinations(weights, 2):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert all(stats[p]["inner_steps"] == steps for p in stage0)
    losses = stats[stage0[0]]["losses"]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3  # it trained, not just averaged
