"""A stage's results on their way from its device to the host. Pure torch.

A GPU result is DMA'd into pinned memory from torch's caching host allocator on a stream of its own
(one per worker), ordered after the kernels that produced it. The compute thread only enqueues the
copy: it goes on launching the next microbatch's kernels while the copy waits for this one's, and
the GPU's queue never drains while the host waits on it. Whoever needs the result on the host
waits for it (`HostCopy.wait`): the worker at once, or, with `WorkerSettings.results_later`, the
compute thread's waiter (runtime/compute.py) while the compute thread moves on.

A CPU result needs no copy; its finiteness flag is computed with it and read at `wait`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor

HostValue = Tensor | EncodedTensor


class HostCopy(Protocol):
    def wait(self) -> tuple[HostValue, bool]:
        """(the result on the host, whether its flag held: finite, or encodable), once it is there."""
        ...


class Ready:
    """A result already on the host; `flag` (a boolean tensor, None: True) is read at `wait`."""

    def __init__(self, value: HostValue, flag: Tensor | None = None) -> None:
        self._value, self._flag = value, flag

    def wait(self) -> tuple[HostValue, bool]:
        return self._value, self._flag is None or bool(self._flag)


class Copying:
    """A result in flight to pinned host memory on a copy stream. When its flag comes back False
    and there is a `fallback`, the result is what the fallback makes instead (a device-encoded
    result whose values the codec could not take goes to the host as a plain tensor)."""

    def __init__(
        self,
        value: HostValue,
        flag: Tensor | None,
        done: torch.cuda.Event,
        fallback: Callable[[], tuple[HostValue, bool]] | None = None,
    ) -> None:
        self._value, self._flag, self._done, self._fallback = value, flag, done, fallback

    def wait(self) -> tuple[HostValue, bool]:
        self._done.synchronize()  # releases the GIL: the compute thread keeps launching meanwhile
        ok = self._flag is None or bool(self._flag)
        if not ok and self._fallback is not None:
            return self._fallback()
        return self._value, ok

    @property
    def arrived(self) -> bool:
        return self._done.query()


class CopyStream:
    """The device-to-host copies of one worker's results, on a CUDA stream of their own."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def start(self, tensor: Tensor, flag: Tensor | None) -> tuple[Tensor, Tensor | None, torch.cuda.Event]:
        """Enqueue `tensor` (and `flag`, a device boolean) into pinned host buffers after the work
        the calling thread's current stream holds; returns (the buffer, the flag's buffer, an event
        recorded once both are there). Nothing here waits on the device."""
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            host_flag = None
            if flag is not None:
                host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                host_flag.copy_(flag, non_blocking=True)
            # Blocking: the waiter sleeps in the driver rather than spinning a core beside the compute thread.
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        # The caller drops its device tensors now; their blocks must not be handed to the compute
        # stream's next kernels before this stream has read them.
        tensor.record_stream(self.stream)
        if flag is not None:
            flag.record_stream(self.stream)
        return host, host_flag, done
