"""Freezing an outer snapshot for the wire, and validating a partner's before it is used."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from noloco_node.codec import decode, encode
from noloco_node.optim.state import OuterState
from noloco_node.rpc.outer_service import EncodedSnapshot, ExpectedTensor


def freeze(state: OuterState, codec: str, poison: float | None = None,
           ) -> tuple[EncodedSnapshot, dict[str, Tensor], list[ExpectedTensor], dict[str, Tensor]]:
    """Encode this replica's fast weights; returns the wire snapshot, our own theta as the partner
    will decode it (so both sides average identical values), what we expect back, and the exact
    frozen theta (to carry over inner progress made while the exchange runs). `poison` (fault
    injection only) corrupts what is sent: NaN, or theta times that factor."""
    tensors, own_wire, expected, frozen = [], {}, [], {}
    for name, (_, theta) in state.snapshot().items():
        sent = theta if poison is None else (torch.full_like(theta, math.nan) if math.isnan(poison) else theta * poison)
        spec, payload = encode(sent, codec)
        tensors.append((name, spec, payload))
        own_wire[name] = decode(*encode(theta, codec)) if poison is not None else decode(spec, payload)
        expected.append(ExpectedTensor(name, tuple(theta.shape), spec.dtype))
        frozen[name] = theta
    return EncodedSnapshot(tensors), own_wire, expected, frozen


def check_snapshot(state: OuterState, received: dict[str, Tensor], *, max_distance_ratio: float,
                   floor: float = 1e-3) -> str | None:
    """Why `received` must not be used, or None if it passes.

    Finite everywhere, and ||theta_peer - phi|| <= ratio * max(||theta - phi||, floor * ||phi||):
    an honest partner's fast weights drift from our slow weights about as far as ours do.
    """
    dist2, delta2, phi2 = 0.0, 0.0, 0.0
    for name, param in state.params.items():
        peer = received.get(name)
        if peer is None:
            return f"missing tensor {name}"
        if not torch.isfinite(peer).all():
            return f"non-finite values in {name}"
        phi = state.phi[name]
        dist2 += float((peer.to(phi.dtype) - phi).pow(2).sum())
        delta2 += float((param.detach().to(phi.dtype) - phi).pow(2).sum())
        phi2 += float(phi.pow(2).sum())
    bound = max_distance_ratio * max(math.sqrt(delta2), floor * math.sqrt(phi2))
    if math.sqrt(dist2) > bound:
        return f"distance to our slow weights {math.sqrt(dist2):.3g} exceeds the bound {bound:.3g}"
    return None
