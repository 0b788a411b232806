"""The weights a stage's compute runs on: bf16 copies of its matmul weights, made once per weight
version instead of once per microbatch (bf16 autocast), and the overlap schedule's weight stash.

Under autocast every forward casts each matmul weight from its fp32 master to bf16 (4 bytes read
and 2 written per parameter), and every graph kept for a backward holds its own cast: stage 0 keeps
the graph of each microbatch of its batch, so at 4 microbatches the casts take 8 bytes per
parameter, as much as Adam's two moments (twice that under the overlap schedule). The weights only
change at a step, so one cast per version serves every microbatch run on it. It is made with its
autograd edge (a `ToCopyBackward` into the fp32 leaf) and handed to the stage through
`functional_call`; autocast leaves a bf16 weight as it is, and each microbatch's weight gradient
flows back through that one cast node into the fp32 gradient exactly as through a cast of its own:
outputs and gradients are the same bit for bit (tests/unit/pipeline/test_weight_casts.py).

A version is the sum of the leaves' version counters, which every in-place change moves (inner and
outer steps, repairs, loaded state): a stale copy is never used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def matmul_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The parameters autocast casts to bf16 in a stage: every Linear's (the LM head's included).
    Not the embedding (a lookup, kept fp32) nor the norms (elementwise, kept fp32)."""
    return tuple(
        f"{prefix}.{name}" if prefix else name
        for prefix, child in module.named_modules()
        if isinstance(child, nn.Linear)
        for name, _ in child.named_parameters(recurse=False)
    )


def weights_version(weights: Iterable[Tensor]) -> int:
    """Moves with every in-place change of any of `weights` (never back)."""
    return sum(w._version for w in weights)


def cast_weights(weights: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """bf16 copies of `weights[names]` that carry their autograd edge to the fp32 leaves, even when
    made under no_grad (a stage's first forward may be gradient-free, its recompute is not)."""
    with torch.enable_grad():
        return {name: weights[name].to(torch.bfloat16) for name in names}


@dataclass(frozen=True)
class Stash:
    """A copy of the weights at one version (pipeline/worker.py, stash_weights)."""

    leaves: dict[str, Tensor]
    """fp32 copies, leaves of autograd: a backward on this version leaves its gradients here."""
    run_on: dict[str, Tensor]
    """What the stage runs on: the leaves, with the matmul weights as their bf16 casts under autocast."""


class WeightCasts:
    """The bf16 casts of one stage's matmul weights (none when `names` is empty: no autocast)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._current: tuple[int, dict[str, Tensor]] | None = None

    def current(self, params: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
        """The casts of the parameters as they are now, made at most once per version; None
        without autocast (the stage runs on its own parameters)."""
        if not self.names:
            return None
        version = weights_version(params.values())
        if self._current is None or self._current[0] != version:
            self._current = None  # the stale copy goes before the new one is made
            self._current = (version, cast_weights(params, self.names))
        return self._current[1]

    def stash(self, params: Mapping[str, Tensor]) -> Stash:
        """A copy of the parameters as they are now, and what the stage runs on for it."""
        leaves = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
        return Stash(leaves, {**leaves, **cast_weights(leaves, self.names)})

    def release(self) -> None:
        """Before a step: the casts are stale after it, and the step's temporaries want the room."""
        self._current = None
