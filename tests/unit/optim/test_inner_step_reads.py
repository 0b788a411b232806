"""The inner step reads the device once: the fused kernel skips a non-finite step by itself, and
the weights' check is one norm over all of them. The fused kernel runs on the CPU too, so its
skip is checked here; the count of host reads needs CUDA's sync debug mode."""

import math
import warnings

import pytest
import torch
from torch import nn

from noloco_node.optim.inner import InnerOptimizer, InnerSchedule

SCHEDULE = InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10)


def _model_and_optimizer(*, fused: bool | None, device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)).to(device)
    return model, InnerOptimizer(model.parameters(), SCHEDULE, fused=fused)


def _backward(model, *, poison: bool = False) -> None:
    device = next(model.parameters()).device
    torch.manual_seed(1)
    (model(torch.randn(4, 8, device=device)).pow(2).sum() * 100).backward()
    if poison:
        model[0].weight.grad[0, 0] = math.nan


def test_the_fused_kernel_skips_a_non_finite_step_on_the_device_and_leaves_adam_untouched():
    model, inner = _model_and_optimizer(fused=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _backward(model, poison=True)
    lr, norm = inner.step()
    assert math.isnan(norm) and inner.skipped_steps == 1 and inner.step_count == 1 and inner.weights_finite
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None
        state = inner.adam.state[p]
        assert float(state["step"]) == 0.0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    _backward(model)
    inner.step()
    assert inner.skipped_steps == 1 and inner.step_count == 2 and not torch.equal(model[0].weight, before["0.weight"])
    assert float(inner.adam.state[model[0].weight]["step"]) == 1.0


def test_fused_and_unfused_steps_agree_and_skip_the_same_steps():
    runs = []
    for fused in (False, True):
        model, inner = _model_and_optimizer(fused=fused)
        norms = []
        for poison in (False, True, False, False):
            _backward(model, poison=poison)
            norms.append(inner.step()[1])
        runs.append((model, inner, norms))
    (plain, plain_inner, plain_norms), (fused, fused_inner, fused_norms) = runs
    assert plain_inner.skipped_steps == fused_inner.skipped_steps == 1
    finite = [True, False, True, True]
    assert [math.isfinite(n) for n in plain_norms] == [math.isfinite(n) for n in fused_norms] == finite
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e30])
def test_weights_that_are_not_finite_or_past_float32s_range_are_found_by_the_step(fused, bad):
    model, inner = _model_and_optimizer(fused=fused)
    _backward(model)
    inner.step()
    assert inner.weights_finite
    with torch.no_grad():
        model[1].bias[0] = bad
    _backward(model)
    inner.step()
    assert not inner.weights_finite


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_on_a_gpu_reads_the_device_once():
    model, inner = _model_and_optimizer(fused=None, device="cuda")
    assert inner.fused
    for poison in (False, True):
        _backward(model, poison=poison)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                inner.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert inner.skipped_steps == 1 and inner.weights_finite
