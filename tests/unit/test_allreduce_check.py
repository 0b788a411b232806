"""HivemindAllReduce's check values: a mean that hivemind delivered only in part is reported as
partial (complete=False), a whole one as complete, on a stand-in averager (no hivemind)."""

import asyncio
import contextlib
import math
import random

import torch

from noloco_node.dht import averaging
from noloco_node.dht.averaging import CHECK_EVERY, HivemindAllReduce


class _Control:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result

    def cancel(self):
        pass


class _StandInAverager:
    """Plays the other member (its tensors are `other`, its check value 1500) and hivemind's
    delivery: every element gets the mean, except the last `lost` elements, which keep ours."""

    def __init__(self, size: int, dtype, lost: int) -> None:
        self.buffer = [torch.zeros(size, dtype=dtype)]
        self.lost = lost
        self.other = None

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffer

    def step(self, gather, timeout, allow_retries, wait):
        ours = self.buffer[0].clone()
        theirs = self.other.clone()
        theirs.view(-1, CHECK_EVERY + 1)[:, CHECK_EVERY] = 1500.0
        mean = (ours + theirs) / 2
        kept = len(mean) - self.lost
        self.buffer[0][:kept] = mean[:kept]
        return _Control({"me": gather, "peer": {"round": gather["round"], "check": 1500.0}})


def _all_reduce(shapes, lost: int, dtype=torch.float64) -> HivemindAllReduce:
    ar = HivemindAllReduce.__new__(HivemindAllReduce)
    ar.shapes = [torch.Size(s) for s in shapes]
    ar.numel = sum(math.prod(s) for s in ar.shapes)
    ar.rows = max(1, math.ceil(ar.numel / CHECK_EVERY))
    ar.rng, ar.bytes_sent, ar.partial_rounds = random.Random(0), 0, 0
    ar.element_size = torch.finfo(dtype).bits // 8
    ar.averager = _StandInAverager(ar.rows * (CHECK_EVERY + 1), dtype, lost)
    return ar


def _run(ar, ours, theirs):
    flat = torch.zeros(ar.rows * CHECK_EVERY, dtype=torch.float64)
    flat[:ar.numel] = torch.cat([t.reshape(-1).double() for t in theirs])
    other = torch.zeros(ar.rows, CHECK_EVERY + 1, dtype=torch.float64)
    other[:, :CHECK_EVERY] = flat.view(ar.rows, CHECK_EVERY)
    ar.averager.other = other.reshape(-1)
    return asyncio.run(ar.mean(ours, timeout_s=1.0, round_index=3))


def test_a_whole_mean_is_complete_and_exact():
    shapes = [(3, 5000), (7,)]
    ours = [torch.randn(s) for s in shapes]
    theirs = [torch.randn(s) for s in shapes]
    means, group, same, complete = _run(_all_reduce(shapes, lost=0), ours, theirs)
    assert (group, same, complete) == (2, True, True)
    for m, a, b in zip(means, ours, theirs):
        assert m.dtype == torch.float32 and m.shape == a.shape
        assert torch.equal(m, ((a.double() + b.double()) / 2).float())


def test_a_mean_with_a_lost_tail_is_reported_partial():
    shapes = [(3, 5000), (7,)]
    for lost in (CHECK_EVERY + 1, 3 * (CHECK_EVERY + 1), 5000):
        ar = _all_reduce(shapes, lost=lost)
        _, _, _, complete = _run(ar, [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes])
        assert complete is False and ar.partial_rounds == 1, lost


def test_check_spacing_is_below_hivemind_part_size():
    # hivemind splits the buffer into parts of 2**19 bytes; a lost part must contain a check value
    assert (CHECK_EVERY + 1) * 8 < 2 ** 19 and averaging.CHECK_EVERY == CHECK_EVERY
