"""DiLoCo baseline in the swarm: hivemind's all-reduce over 3 replicas leaves them on one phi."""

import itertools

import pytest
import torch
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_diloco_three_replicas_share_phi(tmp_path, make_swarm):
    steps = 10
    overrides = tiny_overrides(tmp_path, **{"outer.method": "diloco", "outer.inner_steps_per_outer": 5,
                                            "inner.total_steps": steps, "outer.allreduce_group_size": 3,
                                            # a generous matchmaking window: a replica lagging on a loaded
                                            # 2-core machine must still make the round (a full group
                                            # forms as soon as all 3 are there, so this costs nothing).
                                            "timeouts.match_s": 10.0})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    servers = [swarm.start_node(1, r, "--save-weights") for r in range(3)]
    swarm.wait_ready(servers)
    drivers = [swarm.start_node(0, r, "--steps", str(steps), "--wait-replicas", "3", "--save-weights") for r in range(3)]
    swarm.wait_exit(drivers, timeout_s=240)
    assert all(d.proc.returncode == 0 for d in drivers)
    swarm.stop()

    stats = swarm.node_stats()
    nodes = swarm.out_dir / "nodes"
    for stage in (0, 1):
        members = [p for p, s in stats.items() if s["stage"] == stage]
        rounds = [h for p in members for h in stats[p]["outer_history"]]
        if stage == 1 and not all(h["group"] == 3 and h["same_round"] for h in rounds):
            continue  # stage-1 rounds depend on routing; stage 0 is the exact check
        # Every round must have had all 3: one 2-member group and the replicas' phi differ for good.
        assert all(h["group"] == 3 and h["same_round"] for h in rounds), rounds
        phis = [load_file(str(next(nodes.glob(f"stage{stage}-{p[-8:]}.outer.safetensors")))) for p in members]
        for a, b in itertools.combinations(phis, 2):
            for name in a:
                if name.startswith("phi/"):
                    torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert sum(s["outer"]["rounds"] for s in stats.values() if s["stage"] == 0) == 3 * 2
