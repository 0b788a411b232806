"""Inner LR schedule (reference spot values), InnerOptimizer, and OuterState over parameters."""

import pytest
import torch
from torch import nn

from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.outer import noloco_step
from noloco_node.optim.state import OuterState

SMALL = InnerSchedule(lr_max=6e-4, warmup_steps=1000, total_steps=25000, min_lr_ratio=0.1)


@pytest.mark.parametrize(
    "step,lr",
    [
        (1, 6.0e-7),
        (500, 3.0e-4),
        (1000, 6.0e-4),
        (1001, 6.0e-4),
        (13001, 3.3e-4),
        (25000, 6.00000023e-5),
        (30000, 6.0e-5),
    ],
)
def test_schedule_spot_values(step, lr):
    assert SMALL.lr_at(step) == pytest.approx(lr, rel=1e-6)


def test_schedule_rejects_step_zero():
    with pytest.raises(ValueError):
        SMALL.lr_at(0)


def test_inner_step_clips_over_own_params_and_counts():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = InnerOptimizer(model.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=2, total_steps=10))
    (model(torch.randn(8, 4)).pow(2).sum() * 1000).backward()
    lr, norm = opt.step()
    assert lr == pytest.approx(5e-3) and norm > 1.0 and opt.step_count == 1
    assert all(p.grad is None for p in model.parameters())
    state = opt.adam.state[model.weight]
    assert int(state["step"]) == 1


def test_outer_state_matches_per_tensor_math_and_writes_theta():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    sa = OuterState(a.named_parameters(), alpha=0.5, beta=0.7)
    sb = OuterState(b.named_parameters(), alpha=0.5, beta=0.7)
    with torch.no_grad():
        a.weight.add_(0.1)
        b.bias.sub_(0.2)
    snap_a, snap_b = sa.snapshot(), sb.snapshot()
    expected = {
        n: noloco_step(sa.phi[n], snap_a[n][1], sa.momentum[n], [snap_b[n]], alpha=0.5, beta=0.7) for n in sa.params
    }
    sa.apply_noloco([snap_b])
    sb.apply_noloco([snap_a])
    for name, (phi, m) in expected.items():
        assert torch.equal(sa.phi[name], phi) and torch.equal(sa.momentum[name], m)
        assert torch.equal(sa.params[name].detach(), phi)
    # A pair ends with the same theta on both sides when they started from the same phi and m.
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert sa.round == 1


def test_outer_state_keeps_fp32_master_for_bf16_params():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    state = OuterState(model.named_parameters(), alpha=0.5, beta=0.7)
    assert all(v.dtype == torch.float32 for v in state.phi.values())
    assert all(v.dtype == torch.float32 for v in state.momentum.values())
    with torch.no_grad():
        model.weight.add_(0.5)
    state.apply_noloco([])
    assert model.weight.dtype == torch.bfloat16
    assert torch.allclose(model.weight.float(), state.phi["weight"], atol=1e-2)


def test_state_dict_round_trip_and_missing_peer_param():
    model = nn.Linear(2, 2)
    state = OuterState(model.named_parameters(), alpha=0.5, beta=0.7)
    with pytest.raises(KeyError, match="bias"):
        state.apply_noloco([{"weight": (None, torch.zeros(2, 2))}])
    other = OuterState(nn.Linear(2, 2).named_parameters(), alpha=0.5, beta=0.7)
    other.load_state_dict(state.state_dict(), round_index=3)
    assert other.round == 3
    assert all(torch.equal(other.phi[n], state.phi[n]) for n in state.phi)
