"""NoLoCo outer rounds among one-tensor peers (tests/outer_peers.py): the cases, written once and
run on both harnesses. The fast tier runs every case in process over the in-memory pairing twin
(tests/unit/sync/test_outer_rounds_in_process.py); the integration tier runs the ones whose subject
includes gRPC's streams between real processes (tests/integration/test_outer_exchange.py).

V1 exactly, bf16 wire values bit for bit, one pair + one solo among three, hostile partners
rejected and banned; gamma != beta reaches the oracle (codec none, float64, 1e-9); gamma == beta
picks the theta form by itself; V1 and V2 over the phi+delta form; each lossy codec gives both
sides the math applied to the decoded wire values; top-k's residual travels in the next round."""

import numpy as np
import pytest
import torch

from noloco_node.optim.outer import noloco_step, noloco_step_sent, solo_step
from noloco_node.codec.tensors import decode, encode
from tests.outer_peers import t

f64 = torch.float64
A = dict(phi=[1.0, -2.0, 0.5, 3.0], theta=[1.5, -2.5, 0.25, 3.0], momentum=[0.1, -0.2, 0.0, 0.4])
B = dict(phi=[0.0, -1.0, 1.0, 2.0], theta=[-0.5, -0.5, 1.5, 2.25], momentum=[0.3, 0.0, -0.1, 0.2])
NOLOCO = dict(alpha=0.5, beta=0.7)


V1 = {
    "a": ([0.7, -1.75, 0.7625, 2.9375], [-0.3, 0.25, 0.2625, -0.0625]),
    "b": ([0.5, -1.35, 0.8625, 2.5375], [0.5, -0.35, -0.1375, 0.5375]),
}
V2 = {
    "a": ([0.48, -1.44125, 0.885, 2.94125], [-0.22, 0.30875, 0.1225, 0.00375]),
    "b": ([0.82, -1.62125, 0.715, 3.12125], [0.32, -0.27125, -0.1475, 0.58375]),
}


def oracle(phis, thetas, moms, a, b, g):
    """the reference vectors of docs/research.md: independent of the product's code."""
    P, T, M = (np.asarray(x, float) for x in (phis, thetas, moms))
    Mn = a * M + b * (T - P).mean(0) + g * (P.mean(0) - P)
    return P + Mn, Mn


def wire(x, codec):
    """x as a receiver decodes it; codec may be topk:F or topk:F+int2/int4."""
    from noloco_node.codec.names import parse_outer_codec

    name, fraction = parse_outer_codec(codec)
    spec, payload = encode(x, name, fraction=fraction)
    return decode(spec, payload)


def random_state(seed, n=257):
    # Replicas' slow weights stay close (they start equal); far apart, a partner is rejected.
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=f64) + 0.02 * torch.randn(
        n, generator=g, dtype=f64
    )
    return {
        "phi": phi,
        "theta": phi + 0.05 * torch.randn(n, generator=g, dtype=f64),
        "momentum": 0.01 * torch.randn(n, generator=g, dtype=f64),
    }


def lists(state):
    """What Peers.start saves (it builds the tensors itself)."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_gamma_not_beta_reaches_the_oracle(peers):
    alpha, beta, gamma = 0.45, 0.8, 0.25
    states = {"a": random_state(1), "b": random_state(2)}
    for name, state in states.items():
        peers.start(
            name, lists(state), "--codec", "none", "--alpha", str(alpha), "--beta", str(beta), "--gamma", str(gamma)
        )
    results = peers.run_round()
    want_phi, want_m = oracle(
        [states[n]["phi"] for n in "ab"],
        [states[n]["theta"] for n in "ab"],
        [states[n]["momentum"] for n in "ab"],
        alpha,
        beta,
        gamma,
    )
    for i, name in enumerate("ab"):
        r = results[name]
        assert r["outcome"] == "paired"
        entry = r["history"][0]
        assert entry["payload"] == "phi+delta" and entry["delta_rel_error"] == 0.0
        assert entry["bytes"] == {"phi": 257 * 8, "delta": 257 * 8}
        np.testing.assert_allclose(r["phi"].numpy(), want_phi[i], atol=1e-9, rtol=0)
        np.testing.assert_allclose(r["momentum"].numpy(), want_m[i], atol=1e-9, rtol=0)
        assert torch.equal(r["theta"], r["phi"])


def test_gamma_equal_beta_takes_the_theta_form_by_itself(peers):
    for name, state in (("a", A), ("b", B)):
        peers.start(name, state, "--codec", "none")  # gamma unset = beta
    results = peers.run_round()
    for name in "ab":
        entry = results[name]["history"][0]
        assert entry["outcome"] == "paired" and entry["payload"] == "theta" and entry["bytes"] == {"theta": 4 * 8}
        torch.testing.assert_close(results[name]["phi"], t(V1[name][0]), atol=1e-9, rtol=0)
        torch.testing.assert_close(results[name]["momentum"], t(V1[name][1]), atol=1e-9, rtol=0)


def test_v1_then_v2_over_phi_and_delta(peers):
    offsets = {"a": [0.25, 0.0, -0.125, 0.5], "b": [-0.25, 0.125, 0.0, 0.0]}  # V2's new fast weights - phi
    for name, state in (("a", A), ("b", B)):
        peers.start(
            name, {**state, "offset2": offsets[name]}, "--codec", "none", "--payload", "phi+delta", "--rounds", "2"
        )
    results = peers.run_round()
    for name in "ab":
        r = results[name]
        assert [e["payload"] for e in r["history"]] == ["phi+delta"] * 2
        assert [e["outcome"] for e in r["history"]] == ["paired"] * 2
        for key, vectors in (("@1", V1), ("@2", V2)):
            torch.testing.assert_close(r["phi" + key], t(vectors[name][0]), atol=1e-9, rtol=0)
            torch.testing.assert_close(r["momentum" + key], t(vectors[name][1]), atol=1e-9, rtol=0)


@pytest.mark.parametrize("codec_phi,codec_delta", [("bf16", "none"), ("none", "int8"), ("bf16", "topk:0.1")])
def test_lossy_codecs_give_both_sides_the_math_on_wire_values(peers, codec_phi, codec_delta):
    alpha, beta, gamma = 0.5, 0.7, 0.4
    states = {"a": random_state(3), "b": random_state(4)}
    for name, state in states.items():
        peers.start(name, lists(state), "--codec", codec_phi, "--codec-delta", codec_delta, "--gamma", str(gamma))
    results = peers.run_round()
    on_wire = {n: (wire(s["phi"], codec_phi), wire(s["theta"] - s["phi"], codec_delta)) for n, s in states.items()}
    for me, other in (("a", "b"), ("b", "a")):
        r = results[me]
        assert r["outcome"] == "paired" and r["history"][0]["payload"] == "phi+delta"
        # Our own Delta counts exact under top-k (sync/snapshot.py), as sent under a dense codec.
        own = (
            (on_wire[me][0], states[me]["theta"] - states[me]["phi"]) if codec_delta.startswith("topk") else on_wire[me]
        )
        phi, m = noloco_step_sent(
            states[me]["phi"], states[me]["momentum"], own, [on_wire[other]], alpha=alpha, beta=beta, gamma=gamma
        )
        assert torch.equal(r["phi"], phi) and torch.equal(r["momentum"], m)
        error = r["history"][0]["delta_rel_error"]
        assert (error == 0.0) if codec_delta == "none" else (0 < error < 1)


def sliced(mine, partner, round_index, parts, name="w"):
    """The partner's phi as a sliced exchange gives it to `mine`: its values on the round's slice,
    ours elsewhere (codec/sparse.py, sync/snapshot.py)."""
    from noloco_node.codec.sparse import slice_indices
    from noloco_node.sync.snapshot import slice_key

    seed, parts, part = slice_key(0, 0, round_index, name, parts)
    out = mine.clone()
    on = slice_indices(mine.numel(), parts, part, seed)
    out[on] = partner[on]
    return out, on


@pytest.mark.parametrize("codec_phi,codec_delta", [("slice:0.5", "topk:0.1+int2"), ("slice:0.25", "topk:0.1+int4")])
def test_compressed_exchange_gives_both_sides_the_math_on_wire_values(peers, codec_phi, codec_delta):
    """A sliced phi and a quantized top-k Delta: each side applies the paper's update to what it
    decoded, with the partner's phi taken as its own off the slice (no consensus pull there)."""
    alpha, beta, gamma = 0.5, 0.7, 0.4
    parts = round(1 / float(codec_phi.partition(":")[2]))
    states = {"a": random_state(7, n=1000), "b": random_state(8, n=1000)}
    for name, state in states.items():
        peers.start(name, lists(state), "--codec", codec_phi, "--codec-delta", codec_delta, "--gamma", str(gamma))
    results = peers.run_round()
    round_index = results["a"]["history"][0]["round"]
    deltas = {n: wire(s["theta"] - s["phi"], codec_delta) for n, s in states.items()}
    for me, other in (("a", "b"), ("b", "a")):
        r = results[me]
        assert r["outcome"] == "paired" and r["history"][0]["payload"] == "phi+delta"
        partner_phi, on = sliced(states[me]["phi"], states[other]["phi"], round_index, parts)
        assert 0 < on.numel() < 1000
        exact = states[me]["theta"] - states[me]["phi"]  # our own Delta counts exact under top-k
        phi, m = noloco_step_sent(
            states[me]["phi"],
            states[me]["momentum"],
            (states[me]["phi"], exact),
            [(partner_phi, deltas[other])],
            alpha=alpha,
            beta=beta,
            gamma=gamma,
        )
        assert torch.equal(r["phi"], phi) and torch.equal(r["momentum"], m)
        # Off the slice the consensus term is 0: the step there is the one without the partner's phi.
        no_pull, _ = noloco_step_sent(
            states[me]["phi"],
            states[me]["momentum"],
            (states[me]["phi"], exact),
            [(states[me]["phi"], deltas[other])],
            alpha=alpha,
            beta=beta,
            gamma=gamma,
        )
        off = torch.ones(1000, dtype=torch.bool)
        off[on] = False
        assert torch.equal(r["phi"][off], no_pull[off]) and not torch.equal(r["phi"][~off], no_pull[~off])
        sizes = r["history"][0]["bytes"]
        assert sizes["phi"] == on.numel() * 8  # float64 values on the slice, no index
        assert r["history"][0]["fp32_fraction"] == (sizes["phi"] + sizes["delta"]) / (8 * 1000)


def test_topk_residual_travels_in_the_next_round(peers):
    """The same Delta twice: round 2 sends topk(Delta + what round 1 dropped), on both sides."""
    alpha, beta, gamma, codec = 0.5, 0.7, 0.4, "topk:0.1"
    states = {"a": random_state(5), "b": random_state(6)}
    for name, state in states.items():
        delta = state["theta"] - state["phi"]
        peers.start(
            name,
            lists({**state, "offset2": delta}),
            "--codec",
            "none",
            "--codec-delta",
            codec,
            "--gamma",
            str(gamma),
            "--rounds",
            "2",
        )
    results = peers.run_round()
    phi, mom, sent, residual = {}, {}, {}, {}
    for n, s in states.items():  # round 1, as the math on the wire values
        delta = s["theta"] - s["phi"]
        sent[n] = wire(delta, codec)
        residual[n] = delta - sent[n]
    exact = {n: s["theta"] - s["phi"] for n, s in states.items()}  # our own Delta counts exact under top-k
    for me, other in (("a", "b"), ("b", "a")):
        phi[me], mom[me] = noloco_step_sent(
            states[me]["phi"],
            states[me]["momentum"],
            (states[me]["phi"], exact[me]),
            [(states[other]["phi"], sent[other])],
            alpha=alpha,
            beta=beta,
            gamma=gamma,
        )
        assert torch.equal(results[me]["phi@1"], phi[me])
    # Round 2 starts from theta = new phi + the same Delta; the node recomputes Delta = theta - phi.
    delta2 = {n: (phi[n] + (s["theta"] - s["phi"])) - phi[n] for n, s in states.items()}
    round2 = {n: (phi[n], wire(delta2[n] + residual[n], codec)) for n in states}
    without_feedback = {n: (phi[n], sent[n]) for n in states}
    for me, other in (("a", "b"), ("b", "a")):
        r = results[me]
        assert [e["outcome"] for e in r["history"]] == ["paired"] * 2
        want, want_m = noloco_step_sent(
            phi[me], mom[me], (phi[me], delta2[me]), [round2[other]], alpha=alpha, beta=beta, gamma=gamma
        )
        assert torch.equal(r["phi@2"], want) and torch.equal(r["momentum@2"], want_m)
        stale, _ = noloco_step_sent(
            phi[me], mom[me], (phi[me], delta2[me]), [without_feedback[other]], alpha=alpha, beta=beta, gamma=gamma
        )
        assert not torch.allclose(r["phi@2"], stale, atol=1e-6, rtol=0)
        carried = (sent[me] == 0) & (round2[me][1] != 0)  # dropped in round 1, sent in round 2
        assert carried.any()
        assert r["history"][0]["bytes"]["delta"] == r["history"][1]["bytes"]["delta"] == 26 * (4 + 8)


def test_lone_peer_with_gamma_takes_the_solo_step(peers):
    peers.start("a", A, "--codec", "none", "--gamma", "0.3", "--match-s", "1")
    r = peers.run_round()["a"]
    assert r["outcome"] == "solo" and r["history"][0]["payload"] == "phi+delta"
    torch.testing.assert_close(r["phi"], t([1.4, -2.45, 0.325, 3.2]), atol=1e-9, rtol=0)
    torch.testing.assert_close(r["momentum"], t([0.4, -0.45, -0.175, 0.2]), atol=1e-9, rtol=0)


def test_two_peers_reach_exactly_v1(peers):
    peers.start("a", A, "--codec", "none")
    peers.start("b", B, "--codec", "none")
    results = peers.run_round()
    assert results["a"]["outcome"] == results["b"]["outcome"] == "paired"
    torch.testing.assert_close(results["a"]["phi"], t([0.7, -1.75, 0.7625, 2.9375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["a"]["momentum"], t([-0.3, 0.25, 0.2625, -0.0625]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["b"]["phi"], t([0.5, -1.35, 0.8625, 2.5375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["b"]["momentum"], t([0.5, -0.35, -0.1375, 0.5375]), atol=1e-9, rtol=0)
    assert torch.equal(results["a"]["theta"], results["a"]["phi"])  # theta <- phi


def test_bf16_wire_values_bit_for_bit(peers):
    peers.start("a", A, "--codec", "bf16")
    peers.start("b", B, "--codec", "bf16")
    results = peers.run_round()
    for me, other in (("a", B), ("b", A)):
        mine = A if me == "a" else B
        phi, m = noloco_step(
            t(mine["phi"]),
            wire(t(mine["theta"]), "bf16"),
            t(mine["momentum"]),
            [(None, wire(t(other["theta"]), "bf16"))],
            **NOLOCO,
        )
        assert torch.equal(results[me]["phi"], phi) and torch.equal(results[me]["momentum"], m)


def test_three_replicas_one_pair_one_solo(peers):
    states = {"a": A, "b": B, "c": A}
    for name, state in states.items():
        peers.start(name, state, "--codec", "none", "--match-s", "4")
    results = peers.run_round()
    outcomes = sorted(r["outcome"] for r in results.values())
    assert outcomes == ["paired", "paired", "solo"]
    by_peer = {r["peer_id"]: name for name, r in results.items()}
    for name, r in results.items():
        mine = states[name]
        if r["outcome"] == "solo":
            expected, _ = solo_step(t(mine["phi"]), t(mine["theta"]), t(mine["momentum"]), **NOLOCO)
        else:
            partner = states[by_peer[r["history"][0]["partner"]]]
            expected, _ = noloco_step(
                t(mine["phi"]), t(mine["theta"]), t(mine["momentum"]), [(None, t(partner["theta"]))], **NOLOCO
            )
        torch.testing.assert_close(r["phi"], expected, atol=1e-12, rtol=0)
        assert r["counters"]["rounds"] == 1


@pytest.mark.parametrize("poison", ["nan", "scale"])
def test_hostile_snapshot_rejected_banned_and_solo(peers, poison):
    peers.start("honest", A, "--codec", "none")
    peers.start("hostile", B, "--codec", "none", "--poison", poison)
    results = peers.run_round()
    honest = results["honest"]
    expected, _ = solo_step(t(A["phi"]), t(A["theta"]), t(A["momentum"]), **NOLOCO)
    assert honest["outcome"] == "solo"
    assert honest["counters"]["rejected"] == 1 and honest["banned"] >= 1
    assert torch.isfinite(honest["phi"]).all()
    torch.testing.assert_close(honest["phi"], expected, atol=1e-12, rtol=0)
    # refused before the receipts: the hostile side is told so and pairs with nobody either (it
    # used to get a matching receipt and believe the pair step happened on both sides)
    assert results["hostile"]["outcome"] == "solo" and results["hostile"]["counters"]["paired"] == 0
