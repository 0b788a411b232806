"""A stage's tensors between the host and its device: what arrives from the wire goes to the device,
results go to the host as the transport takes them. Pure torch; the worker's compute thread calls it.

From a GPU a result is cast or encoded there and DMA'd into pinned memory from torch's caching
host allocator on a copy stream (pipeline/host_copies.py); that buffer itself is handed to the
transport (it goes back to the cache once the transport drops it: no second, pageable host copy per
result). Its finiteness flag travels with it, so the host waits on the device once per result, and
only when it needs the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor, encode_on_device
from noloco_node.codec.sizes import DEFAULT_BLOCK
from noloco_node.pipeline.host_copies import Copying, CopyStream, HostCopy, Ready


class Transfers:
    """`host_dtypes` (activations, gradients): the dtype a result is copied to the host in where it
    is not encoded on the device; `device_codecs` (same order): a blockwise codec that direction's
    results are encoded with on the device, or None (WorkerSettings says when each is used)."""

    def __init__(
        self,
        device: torch.device,
        host_dtypes: tuple[torch.dtype, torch.dtype],
        device_codecs: tuple[str | None, str | None],
    ) -> None:
        self.device, self.host_dtypes, self.device_codecs = device, host_dtypes, device_codecs
        self._copies = CopyStream(device) if device.type == "cuda" else None

    def to_device(self, tensor: Tensor) -> Tensor:
        if self.device.type == "cpu":
            return tensor
        # A DMA that overlaps compute needs pinned memory: received payloads arrive pinned
        # (codec/host_memory.py); anything else is pinned here, a host copy on this thread.
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def input_to_device(self, inputs: Tensor) -> Tensor:
        """Received activations on the device, float32 as the stage computes them: a bf16 hop
        arrives as bfloat16 (codec/checked.py's decode_received), so the host copies half the
        bytes and the device widens them. Token ids (stage 0) pass as they are."""
        inputs = self.to_device(inputs)
        if inputs.is_floating_point() and inputs.dtype != torch.float32:
            inputs = inputs.to(torch.float32)
        return inputs

    def to_host(self, tensor: Tensor, direction: int, *, check_finite: bool) -> HostCopy:
        """The result on its way to the host as the transport takes it, its flag whether it is
        finite (always True when not checked). `direction` 0: activations, 1: gradients. Encoded on
        the device where that direction has a device codec and every value is finite and in the
        codec's range; else a host tensor of the direction's host dtype (the transport's codec then
        decides, or refuses, as it would)."""
        codec = self.device_codecs[direction]
        if codec is not None:
            spec, payload, ok = encode_on_device(tensor, codec, DEFAULT_BLOCK)
            if payload.device.type == "cpu":
                if bool(ok):
                    return Ready(EncodedTensor(spec, payload))
            else:
                host, flag, done = self._copies.start(payload, ok)
                # Values the codec cannot take (rare: not finite, or beyond its range) go as a plain
                # tensor instead, decided once the flag is on the host.
                return Copying(
                    EncodedTensor(spec, host), flag, done, lambda: self._plain(tensor, direction, check_finite).wait()
                )
        return self._plain(tensor, direction, check_finite)

    def _plain(self, tensor: Tensor, direction: int, check_finite: bool) -> HostCopy:
        finite = torch.isfinite(tensor).all() if check_finite else None
        if tensor.device.type == "cpu":
            return Ready(tensor, finite)
        host, flag, done = self._copies.start(tensor.detach().to(self.host_dtypes[direction]), finite)
        return Copying(host, flag, done)
