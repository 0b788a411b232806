"""Encoding one outer-snapshot tensor for the wire, with error feedback for top-k. Pure torch.

Outer codecs are written as codec/names.py says: `none`, `bf16`, `int8`, `topk:F` (send the
largest-|x| fraction F of the elements, 0 < F <= 1), `topk:F+int2` / `topk:F+int4` (per chunk,
quantized values) or `slice:F` (phi only). Top-k drops most of a tensor (and rounds what it sends,
with +int2/+int4); error feedback keeps what it dropped on the node and adds it to the next round's
input before selection:

    x_r      = Delta_r + residual_{r-1}
    sent_r   = topk(x_r)                    (the selected elements, as the partner decodes them)
    residual = x_r - sent_r                 (exactly x_r where not selected; the rounding error where selected)

so over rounds nothing is lost, only delayed: sum(sent) + residual == sum(Delta). The residual is
only committed when the round applies the pair step with what was sent (`ErrorFeedback.commit`);
a solo round sent nothing that counts, so the previous residual stays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from noloco_node.codec.names import parse_outer_codec
from noloco_node.codec.tensors import TensorSpec, decode, encode
from noloco_node.optim.norms import squared_distance


@dataclass(frozen=True)
class Encoded:
    spec: TensorSpec
    payload: bytes
    decoded: Tensor
    """What the partner decodes, on the input's device and in its dtype."""
    residual: Tensor | None
    """topk: what the wire did not carry of the input (None for dense codecs)."""
    rel_error: float
    """||decoded - input|| / ||input|| (0 for a zero input), input including the carried residual."""


def encode_tensor(
    x: Tensor, codec: str, residual: Tensor | None = None, slice_key: tuple[int, int, int] | None = None
) -> Encoded:
    """Encode `x` (plus `residual`, for topk) with `codec` as written in the config; `slice_key`
    (seed, parts, part) says which slice the slice codec sends. A slice's `decoded` is 0 off the slice."""
    parsed = parse_outer_codec(codec)
    name, fraction, topk = parsed.wire, parsed.fraction, parsed.topk
    target = x + residual if topk and residual is not None else x
    spec, payload = encode(target, name, fraction=fraction, slice_key=slice_key)
    decoded = decode(spec, payload).to(device=target.device, dtype=target.dtype)
    # Quantized top-k values round too: that error joins the residual, and goes in a later round.
    new_residual = target - decoded if topk else None
    norm = math.sqrt(squared_distance(target))
    error = math.sqrt(squared_distance(decoded, target))
    return Encoded(spec, payload, decoded, new_residual, error / norm if norm > 0 else 0.0)


class ErrorFeedback:
    """Per-parameter top-k residuals kept on this node between outer rounds (never sent)."""

    def __init__(self) -> None:
        self.residual: dict[str, Tensor] = {}

    def get(self, name: str) -> Tensor | None:
        return self.residual.get(name)

    def commit(self, residuals: Mapping[str, Tensor]) -> None:
        """Keep the residuals of a round whose sent values were applied."""
        self.residual.update(residuals)

    def norm(self) -> float:
        return math.sqrt(sum(squared_distance(r) for r in self.residual.values()))
