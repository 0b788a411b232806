"""The one thread that runs a node's torch work, so the event loop never blocks on compute and
forward, backward and optimizer steps never race on the same parameters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class Later:
    """What a compute job returns for a result that is still being produced off the compute thread
    (a GPU's results on their way to the host, pipeline/host_copies.py): `finish()` waits for it and
    gives the job's value, or raises as the job would have. The compute thread moves on to the next
    job meanwhile; `ComputeThread.run` hands `finish` to its waiter thread and returns its value."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self.finish = finish


def then(result: Any, build: Callable[[Any], Any]) -> Any:
    """`build(result)` once `result` is whole: at once, or when its `Later` finishes."""
    if isinstance(result, Later):
        return Later(lambda: build(result.finish()))
    return build(result)


class ComputeThread:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        # Results finish in the order their jobs ran (one copy stream per worker): one waiter is enough.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-wait")
        self._busy = _BusyClock(clock)
        self.clock = clock
        self.started = clock()

    @property
    def busy_s(self) -> float:
        """Seconds during which a job ran or a job's results were still being produced (its kernels
        and copies, when the job returned `Later`); the rest of the wall time the thread waited (on
        the network, mostly): the idle time that experiments report, and capacity routing reads."""
        return self._busy.seconds()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
        """Queue `fn` now (behind the work already queued, ahead of any queued later) and return
        its future, which resolves to its value once it is whole (a `Later` finished); `run` queues
        only once the coroutine is awaited."""
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._executor, functools.partial(self._timed, fn, *args, **kwargs))
        return asyncio.ensure_future(_whole(job))

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._busy.enter()
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self._busy.leave()
            raise
        if isinstance(result, Later):
            # Still busy until it finishes: handed on from here, so it finishes (and is counted)
            # even when nobody awaits it any more.
            return _Finishing(self._waiter.submit(self._finish, result))
        self._busy.leave()
        return result

    def _finish(self, later: Later) -> Any:
        try:
            return later.finish()
        finally:
            self._busy.leave()

    @property
    def idle_s(self) -> float:
        return max(0.0, self.clock() - self.started - self.busy_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._waiter.shutdown(wait=True)


class _Finishing:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future


async def _whole(job: asyncio.Future) -> Any:
    result = await job
    if isinstance(result, _Finishing):
        return await asyncio.wrap_future(result.future)
    return result


class _BusyClock:
    """The union of the intervals during which anything was busy, reported from two threads (the
    compute thread and its waiter): each interval enters and leaves once."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock, self._lock = clock, threading.Lock()
        self._open, self._since, self._closed_s = 0, 0.0, 0.0

    def enter(self) -> None:
        with self._lock:
            if self._open == 0:
                self._since = self._clock()
            self._open += 1

    def leave(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._closed_s += self._clock() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._closed_s + (self._clock() - self._since if self._open else 0.0)


def compute_device(name: str):
    """pipeline.device -> torch.device; 'auto' is cuda when torch sees a GPU."""
    import torch

    from noloco_node.config import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "pipeline.device",
            f"{name} requested but torch sees no CUDA device",
            "use device = 'auto' or 'cpu', or install a CUDA build of torch (see deploy/Dockerfile)",
        )
    return device
