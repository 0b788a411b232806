"""outer.overlap between real processes: two replicas of a one-stage swarm (NoLoCo as pure replica
averaging) whose exchanges are slowed by a fault. Each replica keeps taking inner steps while its
exchange is in flight (the step a round is applied at is past the step it was frozen at), and both
end at the math applied to what they exchanged: two replicas that always pair each other, from the
same phi_0 and zero momentum, compute the same group mean every round, so their slow weights and
momentum stay bit-identical; after the last round (nothing trained after it) theta = phi."""

import pytest
import torch
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_overlapped_exchange_lets_training_go_on_and_both_replicas_end_at_the_math(tmp_path, make_swarm):
    steps, every = 9, 3
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.overlap": "true",
            "outer.inner_steps_per_outer": every,
            "pipeline.num_stages": 1,
            "inner.total_steps": steps,
            # Both replicas must pair in every round. Under a loaded CI box one replica once reached
            # its first round more than 10 s after the other (imports, start skew) and went solo; a
            # wider window costs nothing when they meet at once.
            "timeouts.match_s": 30.0,
            "faults.inject": "during_exchange:delay=1.5",
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    drivers = [
        swarm.start_node(0, r, "--steps", str(steps), "--wait-replicas", "2", "--save-weights") for r in range(2)
    ]
    swarm.wait_exit(drivers, timeout_s=240)
    assert all(d.proc.returncode == 0 for d in drivers)
    swarm.stop()

    stats = swarm.node_stats()
    assert len(stats) == 2
    for peer, s in stats.items():
        history = s["outer_history"]
        assert [r["outcome"] for r in history] == ["paired"] * (steps // every), history
        lag = [r["applied_at_step"] - r["inner_step"] for r in history]
        # Training went on during every exchange but the last (after which there was nothing to train).
        assert all(x > 0 for x in lag[:-1]), lag
        assert s["inner_steps"] == steps and s["microbatches"]["dropped"] == 0
    nodes = swarm.out_dir / "nodes"
    outer = [load_file(str(next(nodes.glob(f"stage0-{p[-8:]}.outer.safetensors")))) for p in stats]
    weights = [load_file(str(next(p for p in nodes.glob(f"stage0-{peer[-8:]}.safetensors")))) for peer in stats]
    for name in outer[0]:
        if name.startswith(("phi/", "momentum/")):
            assert torch.equal(outer[0][name], outer[1][name]), name
    for theta, state in zip(weights, outer):
        for name, value in theta.items():
            torch.testing.assert_close(value, state[f"phi/{name}"].to(value.dtype), rtol=0, atol=0)
