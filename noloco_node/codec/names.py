"""The codecs' names: which the pipeline's hops take, how the outer exchange's are written in the
config, and what each means on the wire. No torch: the config validates with it.

Pipeline (activations and gradients): none | bf16 | int8 | fp8 | int4 (codec/tensors.py).
Outer exchange:

    none | bf16 | int8      dense: every element (phi, Delta or theta)
    topk:F                  Delta: the largest-|x| fraction F, int32 index + exact value each
    topk:F+int2 | +int4     Delta: the largest-|x| fraction F of every 4096-element chunk, 12-bit
                            index + 2- or 4-bit value each (codec/sparse.py)
    slice:F                 phi: exact values on a seeded slice, one part of round(1 / F), a
                            different part each round (every coordinate once in round(1 / F) rounds)
"""

from __future__ import annotations

import math
from typing import NamedTuple

DENSE = ("none", "bf16", "int8")
"""The dense codecs an outer snapshot may take (outer.codec)."""
PIPELINE_CODECS = (*DENSE, "fp8", "int4")
"""The codecs of the pipeline's activations and gradients (fp8 and int4 are blockwise)."""
TOPK_VALUES = {"": "topk", "int2": "topk_int2", "int4": "topk_int4"}
WIRE_CODECS = (*PIPELINE_CODECS, *TOPK_VALUES.values(), "slice")
"""Every codec a tensor header may name."""


class OuterCodec(NamedTuple):
    wire: str
    """The codec a tensor header names: none, bf16, int8, topk, topk_int2, topk_int4 or slice."""
    fraction: float
    """topk: the fraction kept; slice: the fraction sent (1 / parts); 1.0 for the dense codecs."""

    @property
    def dense(self) -> bool:
        return self.wire in DENSE

    @property
    def topk(self) -> bool:
        """A top-k codec: what it drops stays on the node as a residual (optim/compress.py)."""
        return self.wire.startswith("topk")

    @property
    def parts(self) -> int:
        """slice: how many rounds it takes to cover every coordinate once."""
        return max(1, round(1.0 / self.fraction))


def _fraction(text: str, arg: str, example: str) -> float:
    try:
        fraction = float(arg)
    except ValueError:
        raise ValueError(f"codec {text!r}: write {example}") from None
    if math.isnan(fraction) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"codec {text!r}: the fraction must be in (0, 1], e.g. {example}")
    return fraction


def parse_outer_codec(text: str) -> OuterCodec:
    """'topk:0.02+int2' -> OuterCodec('topk_int2', 0.02); raises ValueError that says the fix."""
    name, _, arg = text.partition(":")
    if name == "topk":
        arg, _, values = arg.partition("+")
        if values not in TOPK_VALUES:
            raise ValueError(f"codec {text!r}: top-k values are exact (topk:F), +int2 or +int4, e.g. topk:0.02+int2")
        return OuterCodec(TOPK_VALUES[values], _fraction(text, arg, "topk:0.05 or topk:0.02+int2"))
    if name == "slice":
        return OuterCodec("slice", 1.0 / max(1, round(1.0 / _fraction(text, arg, "slice:0.03125"))))
    if name not in DENSE or arg:
        raise ValueError(f"unknown codec {text!r}; use one of {', '.join(DENSE)}, topk:F[+int2|+int4] or slice:F")
    return OuterCodec(name, 1.0)


def check_phi_codec(text: str) -> OuterCodec:
    codec = parse_outer_codec(text)
    if not (codec.dense or codec.wire == "slice"):
        raise ValueError(f"codec {text!r} is for Delta; phi takes {', '.join(DENSE)} or slice:F (e.g. slice:0.03125)")
    return codec


def check_delta_codec(text: str) -> OuterCodec:
    codec = parse_outer_codec(text)
    if codec.wire == "slice":
        raise ValueError(f"codec {text!r} is for phi; Delta takes {', '.join(DENSE)} or topk:F[+int2|+int4]")
    return codec
