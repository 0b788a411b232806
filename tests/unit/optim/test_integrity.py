"""Inner-loop integrity: running bounds on received tensors, skipped non-finite steps, and weights
restored from phi. Pure torch."""

import math

import pytest
import torch

from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.integrity import RunningBounds, peak_abs, repair_weights, tensor_rms
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.worker import NonFiniteValues, StageWorker, WorkerSettings
from noloco_node.runtime.faults import FaultInjector


def test_rms_does_not_overflow_near_the_float32_limit():
    x = torch.full((4, 8), 3e38) * torch.tensor([1.0, -1.0]).repeat(16).view(4, 8)
    assert tensor_rms(x) == pytest.approx(3e38, rel=1e-6)
    assert tensor_rms(torch.zeros(3)) == 0.0
    assert tensor_rms(torch.tensor([3.0, 4.0])) == pytest.approx(math.sqrt(12.5))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_peak_finds_a_single_non_finite_element(bad, dtype):
    x = torch.randn(3, 1000)
    assert peak_abs(x.to(dtype)) == pytest.approx(float(x.to(dtype).abs().max()))
    x[2, 517] = bad
    peak = peak_abs(x.to(dtype))
    assert math.isnan(peak) if math.isnan(bad) else peak == math.inf
    assert peak_abs(torch.empty(0)) == 0.0


def test_a_bf16_payloads_rms_is_its_float32_values_rms():
    x = torch.randn(4, 64, 256) * 0.3
    narrow = x.to(torch.bfloat16)
    assert tensor_rms(narrow) == pytest.approx(tensor_rms(narrow.float()), rel=1e-2)
    assert tensor_rms(narrow.float()) == pytest.approx(float(narrow.float().pow(2).mean().sqrt()), rel=1e-5)
    big = torch.full((1 << 12,), 1e18)  # a sum of squares past float32's range takes the scaled path
    assert tensor_rms(big) == pytest.approx(1e18, rel=1e-5) and tensor_rms(big.to(torch.bfloat16)) > 9e17


def test_bounds_follow_the_running_median_and_refuse_scaled_payloads():
    torch.manual_seed(0)
    bounds = RunningBounds(factor=1000.0, max_abs=1e6, window=16, min_samples=8)
    normal = [torch.randn(1, 16, 32) * 0.05 for _ in range(8)]
    assert all(bounds.check(t) is None for t in normal)
    probe = torch.randn(1, 16, 32) * 0.05
    assert "outside" in bounds.check(probe * 1e4)
    assert "above this node's limit" in bounds.check(probe * 1e8)
    assert "above this node's limit" in bounds.check(torch.full((1, 16, 32), 3e38))
    assert "non-finite" in bounds.check(torch.full((2,), math.nan))
    assert "outside" in bounds.check(probe * 1e-5)  # far below: refused too
    assert bounds.check(probe * 20) is None  # honest drift within the factor passes
    assert bounds.refused == 5
    # Refused payloads never enter the window; accepted ones move it (training changes the scale).
    for _ in range(16):
        assert bounds.check(torch.randn(1, 16, 32) * 5.0) is None
    assert bounds.check(probe * 1e4) is None  # 500 x 0.05 RMS is now within the moved bounds


def test_bounds_refuse_absurd_values_before_any_history():
    bounds = RunningBounds(factor=1000.0, max_abs=1e6)
    assert bounds.check(torch.full((1, 128, 128), -3e38)) is not None
    assert bounds.check(torch.randn(1, 4, 4) * 1e3) is None  # no history yet: only the absolute limit applies


def _stage_and_optimizer(seed=0):
    torch.manual_seed(seed)
    stage = torch.nn.Linear(4, 4)
    inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=0.1, warmup_steps=1, total_steps=10))
    return stage, inner


def test_an_inner_step_with_non_finite_gradients_is_skipped_and_counted():
    stage, inner = _stage_and_optimizer()
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    stage(torch.randn(2, 4)).sum().backward()
    stage.weight.grad[0, 0] = math.inf
    lr, norm = inner.step()
    assert not math.isfinite(norm) and inner.skipped_steps == 1 and inner.step_count == 1
    for n, p in stage.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert not inner.adam.state  # Adam never saw the bad gradients
    stage(torch.randn(2, 4)).sum().backward()
    inner.step()
    assert inner.skipped_steps == 1 and inner.step_count == 2 and not torch.equal(stage.weight, before["weight"])


def test_repair_restores_theta_from_phi_and_drops_bad_adam_state():
    stage, inner = _stage_and_optimizer()
    outer = OuterState(stage.named_parameters(), alpha=0.5, beta=0.7)
    stage(torch.randn(2, 4)).sum().backward()
    inner.step()
    with torch.no_grad():
        stage.weight.fill_(math.nan)
    inner.adam.state[stage.weight]["exp_avg"].fill_(math.nan)
    assert repair_weights(dict(stage.named_parameters()), outer.phi, inner.adam.state) == "phi"
    assert torch.equal(stage.weight, outer.phi["weight"]) and torch.equal(stage.bias, outer.phi["bias"])
    assert stage.weight not in inner.adam.state and stage.bias in inner.adam.state
    assert (
        repair_weights(
            dict(stage.named_parameters()),
            {"weight": torch.full((4, 4), math.nan), "bias": torch.zeros(4)},
            inner.adam.state,
        )
        is None
    )


class _Stage(torch.nn.Module):
    """The worker's view of a stage: first/last flags, its boundary width, and forward(inputs,
    token_ids, labels): the loss when given labels (the last stage)."""

    is_first, is_last, boundary_width = False, True, 8

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 5)

    def forward(self, x, token_ids=None, labels=None):
        out = self.proj(x)
        return out if labels is None else torch.nn.functional.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))


def _worker(faults=(), with_phi=True):
    torch.manual_seed(0)
    stage = _Stage()
    inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    outer = OuterState(stage.named_parameters(), alpha=0.5, beta=0.7) if with_phi else None
    events = []
    worker = StageWorker(
        stage,
        inner,
        WorkerSettings(batch_size=2, saved_ttl_s=60, auto_step=True),
        faults=FaultInjector(faults),
        slow_weights=(lambda: outer.phi) if with_phi else None,
        emit=lambda event, **fields: events.append(event),
    )
    return worker, stage, outer, events


def test_forced_nan_gradients_skip_exactly_those_steps_and_training_goes_on():
    worker, stage, _, events = _worker(faults=("inner_step:poison@2", "inner_step:poison@4"))
    labels = torch.randint(0, 5, (2, 3))
    for _ in range(5):
        worker.forward_backward_last(torch.randn(2, 3, 8), labels)
    assert worker.inner_steps == 5 and worker.inner.skipped_steps == 2
    assert events.count("inner_step_skipped") == 2
    assert all(torch.isfinite(p).all() for p in stage.parameters())
    assert all(torch.isfinite(v).all() for s in worker.inner.adam.state.values() for v in s.values())


@pytest.mark.parametrize("with_phi", [True, False])
def test_weights_gone_bad_are_restored_and_never_passed_on(with_phi):
    worker, stage, outer, events = _worker(faults=("weights:poison@3",), with_phi=with_phi)
    labels = torch.randint(0, 5, (2, 3))
    for _ in range(4):
        worker.forward_backward_last(torch.randn(2, 3, 8), labels)
    assert worker.repairs == 1 and events.count("weights_repaired") == 1
    assert all(torch.isfinite(p).all() for p in stage.parameters())
    # A non-finite loss is refused before backward: the accumulated gradients stay clean.
    with pytest.raises(NonFiniteValues):
        worker.forward_backward_last(torch.full((2, 3, 8), math.inf), labels)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in stage.parameters())
    assert worker.dropped_non_finite == 1
