"""What a Forward or Backward must look like before a stage takes it: the wire's header and the
call's fields against this stage's shape. Pure checks; every refusal is InvalidPayload, a strike
against the sender (rpc/guard.py)."""

from __future__ import annotations

import math

from noloco_node.codec.names import PIPELINE_CODECS
from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import InvalidPayload
from noloco_node.pipeline.ports import ForwardCall
from noloco_node.pipeline.runtime_settings import StageShape


def check_forward(s: StageShape, call: ForwardCall, spec: TensorSpec) -> tuple[int, int, int]:
    """The activations' [batch, seq, width], or InvalidPayload naming what does not fit."""
    if spec.dtype != "float32" or len(spec.shape) != 3:
        raise InvalidPayload(f"activations must be float32 [batch, seq, width], got {spec.dtype}{list(spec.shape)}")
    _check_codec("activations", spec.codec)
    b, t, h = spec.shape
    if not (1 <= b <= s.microbatch_size and 1 <= t <= s.seq_len and h == s.boundary_width):
        raise InvalidPayload(
            f"activations shape {list(spec.shape)} does not fit [<= {s.microbatch_size}, "
            f"<= {s.seq_len}, {s.boundary_width}]"
        )
    _check_token_list("labels", call.labels, b * t, s.vocab_size)
    if s.carries_token_ids:
        _check_token_list("token ids", call.token_ids, b * t, s.vocab_size)
    elif call.token_ids:
        raise InvalidPayload("token ids sent, but this run's model has no residual subspace")
    if not call.route or call.route[-1].stage != s.stage - 1 or not call.route[-1].address:
        raise InvalidPayload("route must end with a hop of the previous stage and its address")
    if len(call.route) > s.stage:  # one hop per earlier stage: stage 0's, then each one's it passed
        raise InvalidPayload(f"route has {len(call.route)} hops; a forward to stage {s.stage} has at most {s.stage}")
    return b, t, h


def check_gradient(spec: TensorSpec, expected: tuple[int, ...]) -> None:
    """A gradient must be exactly the shape of the output the stage sent, in a hop's codec."""
    if spec.dtype != "float32" or spec.shape != expected:
        raise InvalidPayload(
            f"gradient {spec.dtype}{list(spec.shape)} does not match the output float32{list(expected)}"
        )
    _check_codec("gradient", spec.codec)


def check_reported(loss: float, num_tokens: int, expected: tuple[int, ...]) -> None:
    """What the last stage reports with a gradient, carried back to stage 0's loss: a finite loss,
    and at most one token per position of the microbatch (a hostile-peer audit's NaN, 1e300 and
    2^64 - 1 were answered OK). An honest last stage drops a non-finite result before it sends."""
    if not math.isfinite(loss) or loss < 0.0:
        raise InvalidPayload(f"loss {loss!r} is not a finite cross-entropy")
    positions = math.prod(expected[:2]) if len(expected) >= 2 else 0
    if not 0 <= num_tokens <= positions:
        raise InvalidPayload(f"num_tokens {num_tokens} outside 0..{positions} (the microbatch's positions)")


def _check_codec(what: str, codec: str) -> None:
    """Hops carry every element: a sparse or sliced codec (the outer exchange's) would deliver
    mostly zeros that pass every value check."""
    if codec not in PIPELINE_CODECS:
        raise InvalidPayload(f"{what} in codec {codec}; a hop takes one of {', '.join(PIPELINE_CODECS)}")


def _check_token_list(what: str, values, count: int, vocab_size: int) -> None:
    if len(values) != count:
        raise InvalidPayload(f"{len(values)} {what} for {count} positions")
    if any(not 0 <= value < vocab_size for value in values):
        raise InvalidPayload(f"{what} outside the vocabulary 0..{vocab_size - 1}")
