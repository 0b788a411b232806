"""HivemindAllReduce on a stand-in averager (no hivemind processes): a round in which hivemind
warns that it delivered part of the mean is reported incomplete; a clean round is complete and,
with float64 averaging, every member gets the same float32 mean."""

import asyncio
import contextlib
import logging
import multiprocessing

import torch

from noloco_node.dht.averaging import HivemindAllReduce, _PartialResultCounter, round_key_bits

PARTITION = logging.getLogger("hivemind.averaging.partition")


class _Control:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result

    def cancel(self):
        pass


class _StandInAverager:
    """Plays the other member (tensors `other`) and hivemind: writes local + (mean - local) in
    the buffer dtype, and optionally logs hivemind's partial-result warning."""

    def __init__(self, shapes, dtype, other, warn: str | None) -> None:
        self.buffer = [torch.zeros(s, dtype=dtype) for s in shapes]
        self.other, self.warn = other, warn
        self.group_bits = ""
        self.stepped_with_bits: list[str] = []

    def set_group_bits(self, group_bits: str) -> None:
        self.group_bits = group_bits

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffer

    def step(self, gather, timeout, allow_retries, wait):
        self.stepped_with_bits.append(self.group_bits)
        for mine, theirs in zip(self.buffer, self.other):
            mean = (mine + theirs.to(mine.dtype)) / 2
            mine.add_(mean - mine)
        if self.warn:
            PARTITION.warning(self.warn)
        return _Control({"me": gather, "peer": gather})


def _all_reduce(shapes, other, warn=None, dtype=torch.float64) -> HivemindAllReduce:
    ar = HivemindAllReduce.__new__(HivemindAllReduce)
    ar.partial_warnings = multiprocessing.Value("i", 0)
    ar._handler = _PartialResultCounter(ar.partial_warnings)
    ar.bytes_sent, ar.partial_rounds, ar.element_size, ar.allreduce_s = 0, 0, torch.finfo(dtype).bits // 8, 1.0
    ar.averager = _StandInAverager(shapes, dtype, other, warn)
    return ar


@contextlib.contextmanager
def _attached(ar):
    PARTITION.addHandler(ar._handler)
    try:
        yield
    finally:
        PARTITION.removeHandler(ar._handler)


def test_a_clean_round_is_complete_and_rounds_the_same_mean():
    shapes = [(3, 50), (7,)]
    ours, theirs = [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes]
    ar = _all_reduce(shapes, theirs)
    with _attached(ar):
        means, group, same, complete = asyncio.run(ar.mean(ours, timeout_s=1.0, round_index=3))
    assert (group, same, complete, ar.partial_rounds) == (2, True, True, 0)
    # Matched under round 3's own group key: a replica at another round cannot join this group.
    assert ar.averager.stepped_with_bits == [round_key_bits(3)] and round_key_bits(3) != round_key_bits(4)
    for m, a, b in zip(means, ours, theirs):
        assert m.dtype == torch.float32 and torch.equal(m, ((a.double() + b.double()) / 2).float())


def test_hivemind_partial_result_warnings_make_the_round_incomplete():
    shapes = [(4, 4)]
    for warning in ("Averaging: received 74.7% results", "Reducer: received 50.0% of input tensors"):
        ar = _all_reduce(shapes, [torch.randn(4, 4)], warn=warning)
        with _attached(ar):
            _, group, _, complete = asyncio.run(ar.mean([torch.randn(4, 4)], timeout_s=1.0, round_index=1))
        assert (group, complete, ar.partial_rounds) == (2, False, 1), warning


def test_other_warnings_are_not_counted():
    counter = multiprocessing.Value("i", 0)
    handler = _PartialResultCounter(counter)
    PARTITION.addHandler(handler)
    try:
        PARTITION.warning("It is recommended to set target_group_size to a power of 2")
        PARTITION.info("Averaging: received 10.0% results")  # below WARNING: hivemind does not use it so
    finally:
        PARTITION.removeHandler(handler)
    assert counter.value == 0


def _warn_partial():
    PARTITION.warning("Averaging: received 74.7% results")


def test_the_count_crosses_into_a_forked_process_like_hivemind_averager():
    # hivemind's DecentralizedAverager is an mp.Process forked after the handler is attached
    counter = multiprocessing.get_context("fork").Value("i", 0)
    handler = _PartialResultCounter(counter)
    PARTITION.addHandler(handler)
    try:
        child = multiprocessing.get_context("fork").Process(target=_warn_partial)
        child.start()
        child.join(timeout=30)
    finally:
        PARTITION.removeHandler(handler)
    assert child.exitcode == 0 and counter.value == 1
