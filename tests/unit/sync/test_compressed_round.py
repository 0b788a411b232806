"""The compressed pair update (a sliced phi, a quantized top-k Delta) against an oracle written
from the math in docs/architecture.md (numpy, float64), both sides of a pair; and slice:1.0 with a
dense Delta is today's exchange bit for bit."""

import numpy as np
import pytest
import torch
from torch import nn

from noloco_node.codec.sparse import slice_indices
from noloco_node.optim.state import OuterState
from noloco_node.sync.snapshot import PHI_DELTA, SliceRound, fill_slices, freeze, slice_key, unpack
from noloco_node.sync.memory import decode_snapshot

ALPHA, BETA, GAMMA = 0.5, 0.7, 0.4
N = 300


def replica(seed: int, dtype=torch.float64) -> OuterState:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=dtype)
    model = nn.Module()
    model.w = nn.Parameter(base + 0.02 * torch.randn(N, generator=g, dtype=dtype))
    state = OuterState(model.named_parameters(), alpha=ALPHA, beta=BETA, gamma=GAMMA)
    state.momentum["w"] = 0.01 * torch.randn(N, generator=g, dtype=dtype)
    with torch.no_grad():
        model.w.add_(0.05 * torch.randn(N, generator=g, dtype=dtype))  # theta = phi + Delta
    return state


def pair_round(codec_phi: str, codec_delta: str, round_index: int = 5, dtype=torch.float64):
    """Both sides of one pair round as NoLoCoSync runs it, minus the network: freeze, decode what
    the partner sent, fill the slice, apply."""
    states = {"a": replica(1, dtype), "b": replica(2, dtype)}
    before = {
        n: {"phi": s.phi["w"].clone(), "theta": s.params["w"].detach().clone(), "m": s.momentum["w"].clone()}
        for n, s in states.items()
    }
    frozen = {
        n: freeze(s, PHI_DELTA, codec_phi, codec_delta, round_of=SliceRound(3, 1, round_index))
        for n, s in states.items()
    }
    for me, other in (("a", "b"), ("b", "a")):
        received = decode_snapshot(frozen[other].snapshot, frozen[me].expected, codec_phi)
        peer = fill_slices(states[me], unpack(received, PHI_DELTA, ["w"]), frozen[me].slices)
        states[me].apply_noloco_sent([peer], frozen[me].own, frozen[me].theta)
    return states, before, frozen


@pytest.mark.parametrize(
    "codec_phi,codec_delta",
    [("slice:0.25", "topk:0.05+int2"), ("slice:0.5", "topk:0.05+int4"), ("slice:0.125", "none")],
)
def test_both_sides_reach_the_oracle(codec_phi, codec_delta):
    states, before, frozen = pair_round(codec_phi, codec_delta)
    parts = round(1 / float(codec_phi.partition(":")[2]))
    seed, _, part = slice_key(3, 1, 5, "w", parts)
    mask = np.zeros(N)
    mask[slice_indices(N, parts, part, seed).numpy()] = 1.0
    received = {n: decode_snapshot(f.snapshot, f.expected, codec_phi)["delta/w"].numpy() for n, f in frozen.items()}
    for me, other in (("a", "b"), ("b", "a")):
        phi, phi_peer, m = (before[me]["phi"].numpy(), before[other]["phi"].numpy(), before[me]["m"].numpy())
        own_delta = before[me]["theta"].numpy() - phi  # exact under top-k; what was sent under a dense codec
        if codec_delta == "none":
            np.testing.assert_array_equal(own_delta, received[me])
        # m' = alpha m + beta (Delta_own + Delta-hat_peer) / 2 + gamma * S (phi_peer - phi) / 2;  phi' = phi + m'
        m_new = ALPHA * m + BETA * (own_delta + received[other]) / 2 + GAMMA * mask * (phi_peer - phi) / 2
        np.testing.assert_allclose(states[me].momentum["w"].numpy(), m_new, atol=1e-9, rtol=0)
        np.testing.assert_allclose(states[me].phi["w"].numpy(), phi + m_new, atol=1e-9, rtol=0)
        np.testing.assert_allclose(states[me].params["w"].detach().numpy(), phi + m_new, atol=1e-9, rtol=0)
    if codec_delta != "none":
        assert 0 < frozen["a"].stats["delta_rel_error"] < 1


def test_the_consensus_pulls_of_the_two_sides_are_opposite():
    """With alpha = beta = 0 only gamma * (mean_S(phi) - phi) is left: the two sides pull towards
    the same mean, by opposite amounts (to float rounding), and only on the slice."""
    global ALPHA, BETA
    saved, (ALPHA, BETA) = (ALPHA, BETA), (0.0, 0.0)
    try:
        states, _, _ = pair_round("slice:0.25", "topk:0.05+int2")
        torch.testing.assert_close(states["a"].momentum["w"], -states["b"].momentum["w"], atol=1e-15, rtol=0)
        assert 0 < int((states["a"].momentum["w"] != 0).sum()) <= N // 4 + 64
    finally:
        ALPHA, BETA = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_slice_one_with_a_dense_delta_is_todays_exchange_exactly(dtype):
    today, before, frozen_today = pair_round("none", "none", dtype=dtype)
    sliced, _, frozen_sliced = pair_round("slice:1.0", "none", dtype=dtype)
    for n in ("a", "b"):
        assert torch.equal(today[n].phi["w"], sliced[n].phi["w"])
        assert torch.equal(today[n].momentum["w"], sliced[n].momentum["w"])
    assert frozen_today["a"].stats["bytes"] == frozen_sliced["a"].stats["bytes"]


def test_the_default_sized_round_is_two_percent_of_fp32():
    """slice:0.01 and topk:0.02+int2 on a stage-sized tensor: the bytes that travel against fp32 phi + Delta."""
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(1 << 20))
    state = OuterState(model.named_parameters(), alpha=ALPHA, beta=BETA, gamma=GAMMA)
    with torch.no_grad():
        model.w.add_(0.01 * torch.randn(1 << 20))
    frozen = freeze(state, PHI_DELTA, "slice:0.01", "topk:0.02+int2", round_of=SliceRound(0, 0, 1))
    assert frozen.stats["fp32_fraction"] < 0.02


@pytest.mark.parametrize("change", ["slice_seed", "slice_part", "nnz", "index"])
def test_a_hostile_compressed_snapshot_is_refused_as_invalid(change):
    """What a receiver (gRPC's or the in-memory one) does with a partner's compressed snapshot that
    is not the one this run's config and this round imply: InvalidPayload, which bans the partner
    and ends the round solo (sync/noloco.py)."""
    import dataclasses

    from noloco_node.codec.tensors import encode
    from noloco_node.errors import InvalidPayload
    from noloco_node.sync.ports import EncodedSnapshot

    states = {"a": replica(1), "b": replica(2)}
    frozen = {
        n: freeze(s, PHI_DELTA, "slice:0.25", "topk:0.05+int2", round_of=SliceRound(3, 1, 5)) for n, s in states.items()
    }
    tensors = list(frozen["b"].snapshot.tensors)
    (phi_name, phi_spec, phi_payload), (delta_name, delta_spec, delta_payload) = tensors
    if change == "slice_seed":  # another round's slice, honestly encoded
        seed, parts, part = slice_key(3, 1, 9, "w", 4)
        phi_spec, phi_payload = encode(states["b"].phi["w"], "slice", slice_key=(seed, parts, part))
    elif change == "slice_part":
        phi_spec = dataclasses.replace(phi_spec, slice_part=(phi_spec.slice_part + 1) % 4)
    elif change == "nnz":  # keeps 3x the run's share: an oversized payload
        delta_spec, delta_payload = encode(
            states["b"].params["w"].detach() - states["b"].phi["w"], "topk_int2", fraction=0.15
        )
    else:  # a duplicate index: one chunk, so its scale is bytes 0..3 and indices 0 and 1 bytes 4..6
        raw = bytearray(delta_payload)
        word = int.from_bytes(raw[4:7], "little")
        first = word & 0xFFF
        raw[4:7] = (first | (first << 12)).to_bytes(3, "little")
        delta_payload = bytes(raw)
    hostile = EncodedSnapshot([(phi_name, phi_spec, phi_payload), (delta_name, delta_spec, delta_payload)])
    with pytest.raises(InvalidPayload):
        decode_snapshot(hostile, frozen["a"].expected, "slice:0.25")
    decode_snapshot(frozen["b"].snapshot, frozen["a"].expected, "slice:0.25")  # the honest one passes
