"""The one thread that runs a node's torch work, so the event loop never blocks on compute and
forward, backward and optimizer steps never race on the same parameters."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class ComputeThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.started = time.monotonic()
        self.busy_s = 0.0
        """Seconds the thread spent running work; the rest of the wall time it waited (on the
        network, mostly): the idle time that experiments report."""

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
        """Queue `fn` now (behind the work already queued, ahead of any queued later) and return
        its future; `run` queues only once the coroutine is awaited."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(self._timed, fn, *args, **kwargs))

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_s += time.monotonic() - start

    @property
    def idle_s(self) -> float:
        return max(0.0, time.monotonic() - self.started - self.busy_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


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
