"""Encoding one outer-snapshot tensor for the wire, with error feedback for top-k. Pure torch.

Outer codecs are written `none`, `bf16`, `int8` or `topk:F` (send the largest-|x| fraction F of
the elements, 0 < F <= 1). Top-k drops most of a tensor; error feedback keeps what it dropped
on the node and adds it to the next round's input before selection:

    x_r      = Delta_r + residual_{r-1}
    sent_r   = topk(x_r)                    (exact copies of the selected elements)
    residual = x_r - sent_r                 (exactly x_r where not selected, 0 where selected)

so over rounds nothing is lost, only delayed: sum(sent) + residual == sum(Delta). The residual is
only committed when the round applies the pair step with what was sent (`ErrorFeedback.commit`);
a solo round sent nothing that counts, so the previous residual stays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from noloco_node.codec.tensors import TensorSpec, decode, encode

DENSE_CODECS = ("none", "bf16", "int8")


def parse_codec(text: str) -> tuple[str, float]:
    """'topk:0.05' -> ('topk', 0.05); a dense codec -> (name, 1.0). Raises ValueError with the fix."""
    name, _, arg = text.partition(":")
    if name == "topk":
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"codec {text!r}: write topk:F with a fraction F, e.g. topk:0.05") from None
        if not 0.0 < fraction <= 1.0 or math.isnan(fraction):
            raise ValueError(f"codec {text!r}: the top-k fraction must be in (0, 1], e.g. topk:0.05")
        return name, fraction
    if name not in DENSE_CODECS or arg:
        raise ValueError(f"unknown codec {text!r}; use one of {', '.join(DENSE_CODECS)} or topk:F (e.g. topk:0.05)")
    return name, 1.0


def wire_name(text: str) -> str:
    """The codec as a tensor header names it ('topk:0.05' -> 'topk')."""
    return parse_codec(text)[0]


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


def encode_tensor(x: Tensor, codec: str, residual: Tensor | None = None) -> Encoded:
    """Encode `x` (plus `residual`, for topk) with `codec` as written in the config."""
    name, fraction = parse_codec(codec)
    target = x + residual if name == "topk" and residual is not None else x
    spec, payload = encode(target, name, fraction=fraction)
    decoded = decode(spec, payload).to(device=target.device, dtype=target.dtype)
    new_residual = target - decoded if name == "topk" else None
    norm = float(target.double().norm())
    error = float((decoded.double() - target.double()).norm())
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
        return math.sqrt(sum(float(r.double().pow(2).sum()) for r in self.residual.values()))

