"""Squared distances in float64 a chunk at a time (optim/norms.py): the whole-tensor float64 values,
with no float64 tensor larger than a chunk."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from noloco_node.optim.norms import squared_distance


def whole(x, y=None):
    d = x.double() if y is None else x.double() - y.double()
    return float(d.pow(2).sum())


@pytest.mark.parametrize("numel,chunk", [(1, 4), (10, 3), (12, 4), (1000, 7), (1000, 1 << 22)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_equals_the_whole_float64_computation(numel, chunk, dtype):
    g = torch.Generator().manual_seed(numel)
    x = (
        torch.randn(numel, generator=g).to(dtype).reshape(-1, 1)
        if numel % 2
        else torch.randn(2, numel // 2, generator=g)
    )
    y = torch.randn(x.shape, generator=g).to(x.dtype)
    assert squared_distance(x, y, chunk=chunk) == pytest.approx(whole(x, y), rel=1e-12)
    assert squared_distance(x, chunk=chunk) == pytest.approx(whole(x), rel=1e-12)
    assert squared_distance(x, x.clone(), chunk=chunk) == 0.0
    before = x.clone()
    squared_distance(x, y, chunk=chunk)
    assert torch.equal(x, before)  # the inputs are left as they were


class LargestFloat64(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.largest = max(self.largest, out.numel())
        return out


def test_no_float64_copy_of_the_whole_tensor_is_made():
    x, y = torch.randn(100, 10), torch.randn(100, 10)
    with LargestFloat64() as seen:
        squared_distance(x, y, chunk=64)
    assert seen.largest == 64
    with LargestFloat64() as seen:
        whole(x, y)
    assert seen.largest == 1000
