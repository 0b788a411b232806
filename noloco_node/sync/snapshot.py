"""Freezing an outer snapshot for the wire, and validating a partner's before it is used.

Two forms travel (both sides must use the same; PairRequest.send_slow_weights says which):
- "theta": the fast weights, one tensor per parameter. With gamma == beta the pair update
  beta*mean(Delta) + gamma*(mean(phi) - phi_self) equals beta*(mean(theta) - phi_self), so theta is
  all a partner needs, in half the bytes. Chosen only when it carries the same information as
  the other form: gamma == beta and one dense codec for both phi and Delta.
- "phi+delta": slow weights and outer delta Delta = theta - phi, tensors "phi/<name>" and
  "delta/<name>", each with its own codec: what the paper and the reference exchange; any gamma.
  Delta compresses much better than phi (it is small and, for top-k, sparse-friendly).

phi may travel as a slice (codec_phi = slice:F): exact values on one of P = round(1 / F) parts of
each tensor's coordinates, the part drawn from (run seed, stage, round // P, tensor) and rotated
with round % P, so both sides of every pair agree on it without sending an index, and every
coordinate is covered once in P rounds. Off the slice the receiver takes the partner's phi to
be its own (`fill_slices`): there the consensus term gamma * (mean(phi) - phi_self) is exactly 0,
and on the slice it is the paper's. docs/architecture.md gives the math.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from noloco_node.codec.names import parse_outer_codec
from noloco_node.codec.sizes import per_chunk_count
from noloco_node.codec.sparse import slice_indices
from noloco_node.codec.tensors import topk_count
from noloco_node.optim.compress import encode_tensor
from noloco_node.optim.norms import squared_distance
from noloco_node.optim.state import OuterState
from noloco_node.sync.ports import EncodedSnapshot, ExpectedTensor

THETA, PHI_DELTA = "theta", "phi+delta"


def choose_payload(state: OuterState, codec_phi: str, codec_delta: str) -> str:
    """The snapshot form this node sends: theta only where it loses nothing against phi+delta."""
    same_dense = codec_phi == codec_delta and parse_outer_codec(codec_delta).dense
    return THETA if state.gamma == state.beta and same_dense else PHI_DELTA


def slice_key(run_seed: int, stage: int, round_index: int, name: str, parts: int) -> tuple[int, int, int]:
    """(seed, parts, part) of one tensor's phi slice in a round: the permutation changes every
    `parts` rounds and the part rotates through it, so each coordinate is sent once per `parts` rounds."""
    digest = hashlib.sha256(f"phi-slice:{run_seed}:{stage}:{round_index // parts}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1), parts, round_index % parts


def _expected_nnz(codec: str, numel: int) -> int | None:
    wire, fraction = parse_outer_codec(codec)
    if wire == "topk":
        return topk_count(numel, fraction)
    if wire.startswith("topk_"):
        return per_chunk_count(fraction)
    return None


@dataclass(frozen=True)
class SliceRound:
    """Which round's slices a snapshot uses: the run's seed, the stage and the round."""

    run_seed: int
    stage: int
    round_index: int


@dataclass
class Frozen:
    """One round's snapshot: what is sent and what this side uses of its own values."""

    snapshot: EncodedSnapshot
    expected: list[ExpectedTensor]
    own: dict[str, tuple[Tensor | None, Tensor]]
    """name -> our values as our own update reads them: (None, theta) or (phi, Delta), as the partner
    decodes them (so a dense lossy codec gives both sides the same means), except that a top-k
    Delta counts exact here (the wire keeps a few percent of it) and a sliced phi is our own."""
    theta: dict[str, Tensor]
    """The exact frozen theta (to carry over inner progress made while the exchange runs)."""
    payload: str
    residual: dict[str, Tensor] = field(default_factory=dict)
    """topk residuals to keep if the pair step is applied with what was sent."""
    stats: dict[str, object] = field(default_factory=dict)
    """For the round's history: payload form, bytes per kind, relative errors."""
    slices: dict[str, Tensor] = field(default_factory=dict)
    """codec_phi = slice:F: each tensor's coordinates on this round's slice (what the partner sent of its phi)."""


def _poisoned(theta: Tensor, poison: float | None) -> Tensor:
    if poison is None:
        return theta
    return torch.full_like(theta, math.nan) if math.isnan(poison) else theta * poison


def _ratio(num2: float, den2: float) -> float:
    return math.sqrt(num2 / den2) if den2 > 0 else 0.0


@dataclass
class _Parts:
    """What `freeze` gathers tensor by tensor, and the squared norms its error statistics need."""

    tensors: list = field(default_factory=list)
    expected: list[ExpectedTensor] = field(default_factory=list)
    own: dict = field(default_factory=dict)
    residual: dict[str, Tensor] = field(default_factory=dict)
    slices: dict[str, Tensor] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    err2: float = 0.0
    ref2: float = 0.0
    phi_err2: float = 0.0
    phi2: float = 0.0


def freeze(
    state: OuterState,
    payload: str,
    codec_phi: str,
    codec_delta: str,
    residuals: Mapping[str, Tensor] | None = None,
    poison: float | None = None,
    round_of: SliceRound | None = None,
) -> Frozen:
    """Encode this replica's snapshot in `payload` form. `residuals` are the topk residuals
    carried from earlier rounds. `poison` (fault injection only) corrupts what is sent: NaN, or
    theta times that factor, as a lying peer would; our own side always uses honest values.
    `round_of` says whose slices a slice:F phi sends (required then)."""
    residuals = residuals or {}
    if parse_outer_codec(codec_phi).wire == "slice" and round_of is None:
        raise ValueError("a sliced phi needs the round it is frozen for")
    parts = _Parts(sizes={THETA: 0} if payload == THETA else {"phi": 0, "delta": 0})
    frozen = {}
    with torch.no_grad():
        for name, param in state.params.items():
            phi = state.phi[name]
            theta = frozen[name] = param.detach().to(phi.dtype, copy=True)
            if payload == THETA:
                _add_theta(parts, name, theta, phi, codec_phi, poison)
            else:
                _add_phi_delta(parts, name, theta, phi, codec_phi, codec_delta, residuals.get(name), poison, round_of)
    stats: dict[str, object] = {
        "payload": payload,
        "bytes": parts.sizes,
        "delta_rel_error": _ratio(parts.err2, parts.ref2),
        "drift": math.sqrt(parts.ref2),  # ||Delta|| (with the residual a top-k Delta carries)
    }
    if payload == PHI_DELTA:
        stats["phi_rel_error"] = _ratio(parts.phi_err2, parts.phi2)
        stats["codecs"] = {"phi": codec_phi, "delta": codec_delta}
    else:
        stats["codecs"] = {"theta": codec_phi}
    # Against the dense fp32 form of the same round (phi and Delta, 4 bytes per element each).
    numel = sum(p.numel() for p in state.params.values())
    stats["fp32_fraction"] = sum(parts.sizes.values()) / (8 * numel) if numel else 0.0
    return Frozen(
        EncodedSnapshot(parts.tensors), parts.expected, parts.own, frozen, payload, parts.residual, stats, parts.slices
    )


def _add_theta(parts: _Parts, name: str, theta: Tensor, phi: Tensor, codec: str, poison: float | None) -> None:
    dtype = str(theta.dtype).removeprefix("torch.")
    mine = encode_tensor(theta, codec)
    sent = mine if poison is None else encode_tensor(_poisoned(theta, poison), codec)
    parts.tensors.append((name, sent.spec, sent.payload))
    parts.expected.append(ExpectedTensor(name, tuple(theta.shape), dtype, parse_outer_codec(codec).wire))
    parts.own[name] = (None, mine.decoded)
    parts.sizes[THETA] += len(sent.payload)
    # The error the wire adds to our pull, relative to our drift ||Delta||.
    parts.err2 += squared_distance(mine.decoded, theta)
    parts.ref2 += squared_distance(theta, phi)


def _add_phi_delta(
    parts: _Parts,
    name: str,
    theta: Tensor,
    phi: Tensor,
    codec_phi: str,
    codec_delta: str,
    residual: Tensor | None,
    poison: float | None,
    round_of: SliceRound | None,
) -> None:
    dtype = str(theta.dtype).removeprefix("torch.")
    phi_codec = parse_outer_codec(codec_phi)
    delta = theta - phi
    key = (
        None
        if phi_codec.wire != "slice"
        else slice_key(round_of.run_seed, round_of.stage, round_of.round_index, name, phi_codec.parts)
    )
    enc_phi = encode_tensor(phi, codec_phi, slice_key=key)
    enc_delta = encode_tensor(delta, codec_delta, residual)
    sent_delta = enc_delta if poison is None else encode_tensor(_poisoned(theta, poison) - phi, codec_delta)
    parts.tensors += [
        (f"phi/{name}", enc_phi.spec, enc_phi.payload),
        (f"delta/{name}", sent_delta.spec, sent_delta.payload),
    ]
    parts.expected += [
        ExpectedTensor(f"phi/{name}", tuple(phi.shape), dtype, phi_codec.wire, slice_key=key),
        ExpectedTensor(
            f"delta/{name}",
            tuple(phi.shape),
            dtype,
            parse_outer_codec(codec_delta).wire,
            nnz=_expected_nnz(codec_delta, phi.numel()),
        ),
    ]
    # Our own Delta counts exact under top-k: the wire's Delta keeps a few percent of it, and
    # our own step on that alone would throttle this replica's progress to what it can send
    # (the partner still gets its share; the rest travels later through error feedback).
    own_delta = delta if parse_outer_codec(codec_delta).topk else enc_delta.decoded
    if key is not None:  # exact values on the slice; off it each side reads its own phi
        seed, count, part = key
        parts.slices[name] = slice_indices(phi.numel(), count, part, seed)
        parts.own[name] = (phi, own_delta)
    else:
        parts.own[name] = (enc_phi.decoded, own_delta)
    if enc_delta.residual is not None:
        parts.residual[name] = enc_delta.residual
    parts.sizes["phi"] += len(enc_phi.payload)
    parts.sizes["delta"] += len(sent_delta.payload)
    target = delta if residual is None or enc_delta.residual is None else delta + residual
    parts.err2 += squared_distance(enc_delta.decoded, target)
    parts.ref2 += squared_distance(target)
    parts.phi_err2 += squared_distance(parts.own[name][0], phi)
    parts.phi2 += squared_distance(phi)


def fill_slices(
    state: OuterState, peer: dict[str, tuple[Tensor | None, Tensor]], slices: Mapping[str, Tensor]
) -> dict[str, tuple[Tensor | None, Tensor]]:
    """A sliced phi made whole: the partner's values on the slice, our own phi off it (so the
    consensus term is 0 there). Tensors without a slice pass through."""
    out = {}
    for name, (peer_phi, values) in peer.items():
        coordinates = slices.get(name)
        if coordinates is None or peer_phi is None:
            out[name] = (peer_phi, values)
            continue
        whole = state.phi[name].detach().to("cpu", copy=True).view(-1)
        whole[coordinates] = peer_phi.reshape(-1)[coordinates].to(whole.dtype)
        out[name] = (whole.view(peer_phi.shape), values)
    return out


def unpack(received: Mapping[str, Tensor], payload: str, names: list[str]) -> dict[str, tuple[Tensor | None, Tensor]]:
    """Wire tensors -> name -> (None, theta) or (phi, Delta); a missing tensor is left out."""
    if payload == THETA:
        return {n: (None, received[n]) for n in names if n in received}
    return {
        n: (received[f"phi/{n}"], received[f"delta/{n}"])
        for n in names
        if f"phi/{n}" in received and f"delta/{n}" in received
    }


NON_FINITE = "non-finite"
"""How check_snapshot's answer starts for values no honest partner sends (its sender is banned at once)."""


def check_snapshot(
    state: OuterState,
    received: Mapping[str, tuple[Tensor | None, Tensor]],
    *,
    max_distance_ratio: float,
    floor: float = 1e-3,
    typical_distance: float = 0.0,
    distances: dict[str, float] | None = None,
) -> str | None:
    """Why `received` (as from `unpack`) must not be used, or None if it passes.

    Finite everywhere, and the partner's fast weights (theta, or phi + Delta) and, when sent,
    its slow weights within ratio * max(||theta - phi||, floor * ||phi||, typical_distance) of our
    slow weights: an honest partner's weights drift from ours about as far as our own fast weights
    do, or as far as honest partners were found before (`typical_distance`, the median of the
    last accepted ones, or our own largest drift: once the learning rate has decayed our own drift
    over H steps shrinks ~10x while the replicas' spread does not, and every honest partner was
    refused; sync/pairing.py PartnerDistances passes the larger). The slow weights
    are bounded too, since the gamma term reads them on their own. `distances`, when given,
    receives the measured {"fast", "slow"} distances.
    """
    theta2, phi_peer2, delta2, phi2 = 0.0, 0.0, 0.0, 0.0
    for name, param in state.params.items():
        entry = received.get(name)
        if entry is None:
            return f"missing tensor {name}"
        peer_phi, values = entry
        for kind, tensor in (("slow weights", peer_phi), ("values", values)):
            if tensor is not None and not torch.isfinite(tensor).all():
                return f"{NON_FINITE} {kind} in {name}"
        phi = state.phi[name]
        if peer_phi is None:
            peer_theta = values.to(phi.dtype)
        else:
            peer_phi = peer_phi.to(device=phi.device, dtype=phi.dtype)
            peer_theta = peer_phi + values.to(device=phi.device, dtype=phi.dtype)
            phi_peer2 += float((peer_phi - phi).pow(2).sum())
        theta2 += float((peer_theta.to(phi.device) - phi).pow(2).sum())
        delta2 += float((param.detach().to(phi.dtype) - phi).pow(2).sum())
        phi2 += float(phi.pow(2).sum())
    bound = max_distance_ratio * max(math.sqrt(delta2), floor * math.sqrt(phi2), typical_distance)
    if distances is not None:
        distances.update(fast=math.sqrt(theta2), slow=math.sqrt(phi_peer2))
    for what, dist in (("fast", math.sqrt(theta2)), ("slow", math.sqrt(phi_peer2))):
        if dist > bound:
            return (
                f"distance of the partner's {what} weights to our slow weights {dist:.3g} exceeds the bound {bound:.3g}"
            )
    return None
