"""A stage's tensors between the host and its device: what arrives from the wire goes to the device,
results go to the host as the transport takes them. Pure torch; the worker's compute thread calls it.

From a GPU a result is cast or encoded there, DMA'd into pinned memory from torch's caching host
allocator and that buffer itself is handed to the transport (it goes back to the cache once the
transport drops it: no second, pageable host copy per result). Its finiteness flag travels with it,
so the host waits on the device once per result instead of twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor, encode_on_device
from noloco_node.codec.sizes import DEFAULT_BLOCK


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

    def to_host(self, tensor: Tensor, direction: int, *, check_finite: bool) -> tuple[Tensor | EncodedTensor, bool]:
        """(the result as the transport takes it, whether it is finite: True when not checked).
        `direction` 0: activations, 1: gradients. Encoded on the device where that direction has a
        device codec and every value is finite and in the codec's range; else a host tensor of the
        direction's host dtype (the transport's codec then decides, or refuses, as it would)."""
        codec = self.device_codecs[direction]
        if codec is not None:
            encoded = self._encode_here(tensor, codec)
            if encoded is not None:
                return encoded, True
        if tensor.device.type == "cpu":
            return tensor, not check_finite or bool(torch.isfinite(tensor).all())
        finite = torch.isfinite(tensor).all() if check_finite else None
        return _pinned(tensor.detach().to(self.host_dtypes[direction]), finite)

    def _encode_here(self, tensor: Tensor, codec: str) -> EncodedTensor | None:
        """`tensor` encoded on its device, its payload on the host after one wait; None when a value
        is not finite or out of the codec's range."""
        spec, payload, ok = encode_on_device(tensor, codec, DEFAULT_BLOCK)
        payload, good = (payload, bool(ok)) if payload.device.type == "cpu" else _pinned(payload, ok)
        return EncodedTensor(spec, payload) if good else None


def _pinned(tensor: Tensor, flag: Tensor | None) -> tuple[Tensor, bool]:
    """A device tensor DMA'd into pinned host memory, with `flag` (a device boolean; None: True)
    read alongside, after one wait on the device."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    host_flag = None
    if flag is not None:
        host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        host_flag.copy_(flag, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host, host_flag is None or bool(host_flag)
