"""Results the compute thread does not wait for (runtime/compute.py's Later, the worker's
`results_later`): the compute thread runs the next job while a result is still on its way, the
caller of `ComputeThread.run` gets the whole value or the job's error, and the thread's busy time
counts until the result is whole."""

import asyncio
import threading

import pytest
import torch

from noloco_node.pipeline.worker import NonFiniteValues, StageWorker, WorkerSettings
from noloco_node.runtime.compute import ComputeThread, Later

from .tiny_workers import HIDDEN, SEQ, tiny_worker

WAIT_S = 10.0


def test_the_compute_thread_runs_the_next_job_while_a_result_is_still_on_its_way():
    release = threading.Event()

    def finish():  # times out (and the test fails) unless the next job runs meanwhile
        assert release.wait(WAIT_S), "the next job did not run while this result was on its way"
        return "whole"

    async def main():
        compute = ComputeThread()
        try:
            first = compute.submit(lambda: Later(finish))
            await compute.run(release.set)
            return await asyncio.wait_for(first, WAIT_S)
        finally:
            compute.shutdown()

    assert asyncio.run(main()) == "whole"


def test_a_result_that_fails_once_on_the_host_raises_to_the_caller_as_the_job_would():
    def finish():
        raise NonFiniteValues("output of mb is not finite")

    async def main():
        compute = ComputeThread()
        try:
            with pytest.raises(NonFiniteValues):
                await compute.run(lambda: Later(finish))
            return await compute.run(lambda: 7)
        finally:
            compute.shutdown()

    assert asyncio.run(main()) == 7


def test_busy_time_counts_until_a_result_is_whole_and_not_twice_where_jobs_overlap_it():
    now = [0.0]
    release = threading.Event()

    def first_job():
        now[0] = 1.0  # the job returns at t=1, its result still on its way
        return Later(lambda: release.wait(WAIT_S))

    def second_job():
        now[0] = 3.0  # ran from t=1 to t=3, inside the first result's interval

    def third_job():
        now[0] = 7.0

    async def main():
        compute = ComputeThread(clock=lambda: now[0])
        try:
            first = compute.submit(first_job)
            await compute.run(second_job)
            assert compute.busy_s == 3.0  # still open: t=0 to now
            now[0] = 5.0
            release.set()
            assert await asyncio.wait_for(first, WAIT_S)
            busy_after_first = compute.busy_s
            now[0] = 6.0
            await compute.run(third_job)
            now[0] = 10.0
            return busy_after_first, compute.busy_s, compute.idle_s
        finally:
            compute.shutdown()

    assert asyncio.run(main()) == (5.0, 6.0, 4.0)  # [0, 5] and [6, 7]; idle [5, 6] and [7, 10]


def test_a_result_nobody_waits_for_any_more_still_finishes_and_closes_its_busy_time():
    now = [0.0]
    release, finished = threading.Event(), threading.Event()

    def finish():
        release.wait(WAIT_S)
        finished.set()

    async def main():
        compute = ComputeThread(clock=lambda: now[0])
        try:
            waiting = asyncio.ensure_future(compute.run(lambda: Later(finish)))
            await asyncio.sleep(0.05)
            waiting.cancel()
            now[0] = 2.0
            release.set()
            assert await asyncio.to_thread(finished.wait, WAIT_S)
        finally:
            compute.shutdown()  # waits for the waiter
        now[0] = 9.0
        return compute.busy_s

    assert asyncio.run(main()) == 2.0


def later_worker(stage_index: int, num_stages: int) -> StageWorker:
    plain = tiny_worker(stage_index, num_stages, batch_size=2, auto_step=False)
    settings = WorkerSettings(batch_size=2, saved_ttl_s=60.0, auto_step=False, results_later=True)
    return StageWorker(plain.stage, plain.inner, settings)


def test_a_worker_leaving_its_results_later_gives_the_same_results_once_they_finish():
    inputs = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(3))
    now = tiny_worker(1, 3, batch_size=2, auto_step=False)
    later = later_worker(1, 3)
    output = later.forward("mb", inputs)
    grad_input = later.backward("mb", grad)
    assert isinstance(output, Later) and isinstance(grad_input, Later)
    assert torch.equal(output.finish(), now.forward("mb", inputs))
    assert torch.equal(grad_input.finish(), now.backward("mb", grad))
    last_now, last_later = tiny_worker(2, 3, batch_size=2, auto_step=False), later_worker(2, 3)
    result = last_later.forward_backward_last(inputs, labels)
    assert isinstance(result, Later)
    (grad_a, loss_a, tokens_a), (grad_b, loss_b, tokens_b) = (
        result.finish(),
        last_now.forward_backward_last(inputs, labels),
    )
    assert torch.equal(grad_a, grad_b) and loss_a == loss_b and tokens_a == tokens_b == 2 * SEQ
    first = later_worker(0, 3)
    kept = first.forward("mb", labels, keep_graph=True)  # stage 0: token ids in, its graph kept
    assert isinstance(kept, Later) and kept.finish().shape == (2, SEQ, HIDDEN)
    assert first.backward("mb", grad) is None  # nothing goes upstream of stage 0, nothing to wait for


def test_a_non_finite_result_left_for_later_is_dropped_when_it_finishes():
    worker = later_worker(1, 3)
    output = worker.forward("mb", torch.full((2, SEQ, HIDDEN), float("nan")))
    assert worker.dropped_non_finite == 0  # not read yet
    with pytest.raises(NonFiniteValues):
        output.finish()
    assert worker.dropped_non_finite == 1
