"""How a stage's state travels to a joining replica (Outer.FetchState, rpc/state_service.py):
the tensors of each parameter, grouped by parameter, and the codec each kind travels in.

What travels exactly and what compactly (the `compact` encoding a joiner asks for):
  phi/<p>              "none" (exact). phi is the model: it is what theta restarts from, and
                       replicas' phi differ by less than bf16's rounding, so rounding it would
                       move the joiner further from its stage than the stage's replicas are apart.
  momentum/<p>         "bf16". The outer momentum m is a running average of deltas scaled by beta
                       and enters phi only through alpha * m: 8 mantissa bits (relative error
                       <= 2^-9) are below the noise of one outer round.
  adam_exp_avg/<p>     "int8" blockwise (64 per block): signed, |error| <= absmax / 254 per block.
                       The first moment is a smoothed gradient; its error is of the order of the
                       gradient noise one step adds to it anyway.
  adam_exp_avg_sq/<p>  "bf16", NOT int8 or fp8: the update divides by sqrt(v). A small second
                       moment next to a large one in a block would decode to 0 under a shared
                       scale, and Adam would then divide by eps (a step of lr * m / eps). bf16
                       keeps every value's own exponent (relative error <= 2^-9), so no v turns 0.
Dense, the state is 16 bytes per parameter (four fp32 tensors); compact, 4 + 2 + (1 + 4/64) + 2
= 9.06 bytes (benchmarks/joiner_fetch.py prints the measured sizes).

A top-up (the TOP_UP encoding, sync/top_up.py) sends phi/<p> alone, as the difference between
the donor's phi now and the phi the joiner holds of it, int8 blockwise: 1.06 bytes per parameter.
The difference of a few outer rounds is small, so its rounding error (absmax / 254 of a block of
the difference) is far below the replicas' spread; the donor records what the joiner then holds,
so a later top-up carries the rounding too.

Tensors travel grouped by parameter (its phi, m and both Adam moments together), so that a joiner
whose donor dies mid-transfer keeps every parameter it received whole and asks another donor for
the rest (sync/state_fetch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from noloco_node.codec.tensors import DEFAULT_BLOCK, DTYPE_NAMES, TensorSpec, expected_payload_bytes

KINDS = ("phi", "momentum", "adam_exp_avg", "adam_exp_avg_sq")
ADAM_KINDS = ("adam_exp_avg", "adam_exp_avg_sq")
COMPACT_CODECS = {"phi": "none", "momentum": "bf16", "adam_exp_avg": "int8", "adam_exp_avg_sq": "bf16"}
TOP_UP_CODEC = "int8"
STATE_BLOCK = DEFAULT_BLOCK
MAX_REQUESTED_NAMES = 1 << 16
"""A request naming more parameters than this is refused before the donor copies anything (a
stage of the largest preset has a few hundred)."""


@dataclass
class ReceivedState:
    """What one donor's stream has delivered so far: its counters (once its manifest is in) and
    each tensor as it arrives. A failed fetch leaves here what came before the failure."""

    counters: dict | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)


def split_name(tensor_name: str) -> tuple[str, str]:
    """("phi", "layers.0.w") for "phi/layers.0.w"; a name without a known kind is its own
    parameter, of kind "" (sent exactly)."""
    kind, sep, parameter = tensor_name.partition("/")
    return (kind, parameter) if sep and kind in KINDS else ("", tensor_name)


def state_codec(tensor_name: str, dtype: torch.dtype, compact: bool, top_up: bool = False) -> str:
    """The codec a state tensor travels in: always "none" when dense, else by kind (module doc);
    int8 in a top-up. Non-float tensors travel exactly whatever was asked."""
    if not dtype.is_floating_point or not (compact or top_up):
        return "none"
    if top_up:
        return TOP_UP_CODEC
    return COMPACT_CODECS.get(split_name(tensor_name)[0], "none")


def state_spec(
    tensor_name: str, shape: tuple[int, ...], dtype: torch.dtype, compact: bool, top_up: bool = False
) -> TensorSpec:
    """The spec (and so the payload size) of one state tensor in the chosen encoding."""
    codec = state_codec(tensor_name, dtype, compact, top_up)
    spec = TensorSpec(
        dtype=DTYPE_NAMES[dtype], shape=tuple(shape), codec=codec, block_size=STATE_BLOCK if codec == "int8" else 0
    )
    return replace(spec, payload_bytes=expected_payload_bytes(spec))


def parameter_bytes(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], compact: bool) -> dict[str, int]:
    """Payload bytes per parameter (all its tensors) in the chosen encoding, in `expected`'s order."""
    out: dict[str, int] = {}
    for name, (shape, dtype) in expected.items():
        parameter = split_name(name)[1]
        out[parameter] = out.get(parameter, 0) + state_spec(name, shape, dtype, compact).payload_bytes
    return out


def tensors_by_parameter(names) -> dict[str, list[str]]:
    """Tensor names grouped by their parameter, parameters in first-seen order, each parameter's
    tensors in KINDS order: the order a donor sends them in."""
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(split_name(name)[1], []).append(name)
    rank = {kind: i for i, kind in enumerate(("", *KINDS))}
    return {p: sorted(ts, key=lambda t: rank[split_name(t)[0]]) for p, ts in grouped.items()}


def select_state(tensor_names, requested: list[str]) -> dict[str, list[str]]:
    """What a donor sends for a request naming `requested` parameters (empty: everything), grouped
    by parameter. Raises ValueError, naming the offending parameter, for an unknown or repeated
    name or more names than the stage has parameters."""
    grouped = tensors_by_parameter(tensor_names)
    if not requested:
        return grouped
    if len(requested) > len(grouped):
        raise ValueError(f"{len(requested)} parameters asked for; this stage has {len(grouped)}")
    out: dict[str, list[str]] = {}
    for parameter in requested:
        if parameter in out:
            raise ValueError(f"parameter {parameter!r} is asked for twice")
        if parameter not in grouped:
            raise ValueError(
                f"unknown parameter {parameter!r}: not one of this stage's {len(grouped)} parameters "
                f"(names as in the donor's phi/<name> tensors, e.g. {next(iter(grouped))!r})"
            )
        out[parameter] = grouped[parameter]
    return out
