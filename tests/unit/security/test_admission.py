"""Signed call tokens, identities, the per-peer guard and the DHT authorizer, without a network."""

import asyncio
import time

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from noloco_node.dht.auth import SwarmKeyAuthorizer
from noloco_node.rpc.admission import SwarmKeyError, load_swarm_key
from noloco_node.rpc.guard import GuardLimits, PeerGuard
from noloco_node.transport.credentials import AUTH_HEADER, KEY_HEADER, CallAuthError, CallSigner, CallVerifier
from noloco_node.transport.identity import NodeIdentity, peer_id_of_owner_marker

KEY, OTHER = b"k" * 32, b"o" * 32
METHOD = "/noloco.wire.v1.Stage/Forward"
ALICE, BOB, SERVER = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()


def _verifier(key=None, skew=60.0):
    return CallVerifier(SERVER.peer_id, swarm_key=key, max_skew_s=skew)


def test_identity_peer_id_is_libp2ps_and_survives_a_restart(tmp_path):
    path = tmp_path / "node.key"
    first = NodeIdentity.load_or_create(path)
    assert PeerID.from_identity(path.read_bytes()).to_base58() == first.peer_id
    assert NodeIdentity.load_or_create(path).peer_id == first.peer_id
    (tmp_path / "junk").write_bytes(b"junk")
    with pytest.raises(ValueError, match="remove this one to create a new identity"):
        NodeIdentity.load_or_create(tmp_path / "junk")


def test_record_owner_marker_proves_the_signers_peer_id():
    from hivemind.dht.crypto import RSASignatureValidator

    marker = RSASignatureValidator(ALICE.hivemind_key()).local_public_key
    assert peer_id_of_owner_marker(marker) == ALICE.peer_id != BOB.peer_id
    assert peer_id_of_owner_marker(b"[owner:garbage]") is None and peer_id_of_owner_marker(b"plain") is None


def test_signed_call_proves_the_caller():
    metadata = dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id))
    assert _verifier().verify(metadata, METHOD) == ALICE.peer_id


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda md: md.pop(AUTH_HEADER), "unsigned"),
        (lambda md: md.update({KEY_HEADER: BOB.public_b64}), "does not belong"),
        (lambda md: md.update({AUTH_HEADER: md[AUTH_HEADER].replace(ALICE.peer_id, BOB.peer_id)}), "does not belong"),
        (lambda md: md.update({AUTH_HEADER: md[AUTH_HEADER][:-8] + "AAAAAAA="}), "does not verify"),
    ],
)
def test_forged_or_borrowed_tokens_are_refused(tamper, message):
    metadata = dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id))
    tamper(metadata)
    with pytest.raises(CallAuthError, match=message):
        _verifier().verify(metadata, METHOD)


def _with_part(metadata: dict, index: int, make) -> dict:
    parts = metadata[AUTH_HEADER].split(".")
    parts[index] = make(parts[index])
    return {**metadata, AUTH_HEADER: ".".join(parts)}


@pytest.mark.parametrize(
    "index, make",
    [
        (2, lambda nonce: "z" * 32),  # the nonce is 32 lower-case hex characters
        (2, lambda nonce: nonce.upper()),
        (3, lambda sig: sig.replace("-", "+").replace("_", "/") if ("-" in sig or "_" in sig) else "+" + sig[1:]),
        (3, lambda sig: sig[:10] + "!" + sig[11:]),
        (1, lambda stamp: "-" + stamp),
    ],
)
def test_a_token_outside_the_documented_format_is_malformed(index, make):
    """A hostile-peer audit found a nonce of 'z' * 32 and standard base64 with '+/' accepted."""
    metadata = _with_part(dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id)), index, make)
    with pytest.raises(CallAuthError, match="malformed x-noloco-auth token"):
        _verifier().verify(metadata, METHOD)


def test_token_is_bound_to_server_method_and_time_and_cannot_be_replayed():
    verifier = _verifier()
    for_other_server = dict(CallSigner(ALICE).metadata(METHOD, BOB.peer_id))
    with pytest.raises(CallAuthError, match="does not verify"):
        verifier.verify(for_other_server, METHOD)
    for_other_method = dict(CallSigner(ALICE).metadata("/noloco.wire.v1.Outer/Exchange", SERVER.peer_id))
    with pytest.raises(CallAuthError, match="does not verify"):
        verifier.verify(for_other_method, METHOD)
    stale = dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id, now=time.time() - 120))
    with pytest.raises(CallAuthError, match="from ours"):
        verifier.verify(stale, METHOD)
    fresh = dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id))
    assert verifier.verify(fresh, METHOD) == ALICE.peer_id
    with pytest.raises(CallAuthError, match="replay"):
        verifier.verify(fresh, METHOD)
    assert verifier.replays == 1


def test_swarm_key_mac_is_required_in_a_keyed_swarm():
    verifier = _verifier(key=KEY)
    assert verifier.verify(dict(CallSigner(ALICE, KEY).metadata(METHOD, SERVER.peer_id)), METHOD) == ALICE.peer_id
    for signer in (CallSigner(ALICE), CallSigner(ALICE, OTHER)):
        with pytest.raises(CallAuthError, match="swarm's key"):
            verifier.verify(dict(signer.metadata(METHOD, SERVER.peer_id)), METHOD)


def test_verifier_tables_stay_bounded_and_never_forget_a_live_nonce():
    verifier = CallVerifier(SERVER.peer_id, swarm_key=None, max_skew_s=60, max_keys=2, max_nonces=5)
    for identity in (ALICE, BOB, NodeIdentity.generate()):
        verifier.verify(dict(CallSigner(identity).metadata(METHOD, SERVER.peer_id)), METHOD)
    assert len(verifier._keys) <= 2
    first = dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id))
    verifier.verify(first, METHOD)
    verifier.verify(dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id)), METHOD)
    with pytest.raises(CallAuthError, match="too many calls"):  # full: refuse rather than forget
        verifier.verify(dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id)), METHOD)
    with pytest.raises(CallAuthError, match="replay"):
        verifier.verify(first, METHOD)
    assert len(verifier._nonces) == 5
    later = time.time() + 121  # past twice the skew window the old nonces expire and room returns
    verifier.verify(dict(CallSigner(ALICE).metadata(METHOD, SERVER.peer_id, now=later)), METHOD, now=later)


def test_key_file_errors_name_the_fix(tmp_path):
    (tmp_path / "bad").write_text("not hex")
    (tmp_path / "short").write_text("abcd")
    (tmp_path / "good").write_text("ab" * 32 + "\n")
    with pytest.raises(SwarmKeyError, match="keygen"):
        load_swarm_key(tmp_path / "bad")
    with pytest.raises(SwarmKeyError, match="at least 16"):
        load_swarm_key(tmp_path / "short")
    assert load_swarm_key(tmp_path / "good") == bytes.fromhex("ab" * 32)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def guard(clock, **kw):
    args = dict(requests_per_s=10, burst=3, max_streams=2, ban_after_invalid=2, ban_s=10, ban_max_s=25)
    args.update(kw)
    return PeerGuard(GuardLimits(**args), clock=clock)


def test_rate_limit_refills_at_the_rate():
    clock = Clock()
    g = guard(clock, max_streams=100)
    assert [g.admit("a") for _ in range(3)] == [None] * 3
    assert "rate limit" in g.admit("a")
    assert g.admit("b") is None  # limits are per peer
    clock.now += 0.1  # 10/s -> one token back
    assert g.admit("a") is None and "rate limit" in g.admit("a")


def test_stream_cap_counts_calls_in_progress():
    g = guard(Clock(), burst=100)
    assert g.admit("a") is None and g.admit("a") is None
    assert "in progress" in g.admit("a")
    g.finish("a")
    assert g.admit("a") is None


def test_bans_double_up_to_the_cap_and_expire():
    clock = Clock()
    g = guard(clock, burst=1000, max_streams=1000)
    lengths = []
    for _ in range(4):
        g.admit("bad")
        assert g.finish("bad", invalid="invalid_argument") is None
        g.admit("bad")
        lengths.append(g.finish("bad", invalid="invalid_argument"))
        assert "banned" in g.admit("bad")
        clock.now += lengths[-1] + 0.01
    assert lengths == [10, 20, 25, 25]
    assert g.admit("bad") is None and g.stats.bans == 4
    assert g.admit("good") is None


def test_tracked_peers_are_bounded_against_rotating_identities():
    g = guard(Clock(), max_peers=50)
    for i in range(10_000):
        g.admit(f"peer{i}")
        g.finish(f"peer{i}")
    assert g.tracked() == 50


def test_dht_authorizer_accepts_its_own_swarm_and_refuses_others():
    async def scenario():
        ours, ours_too, theirs = SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(OTHER)
        request = dht_pb2.StoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1.0])
        await ours.sign_request(request)
        assert await ours_too.validate_request(request)
        assert not await ours_too.validate_request(request), "a replayed request must be refused"
        forged = dht_pb2.StoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1.0])
        await theirs.sign_request(forged)
        assert not await ours.validate_request(forged)
        tampered = dht_pb2.StoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1.0])
        await ours.sign_request(tampered)
        tampered.values[0] = b"evil"
        assert not await ours_too.validate_request(tampered)
        unsigned = dht_pb2.StoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1.0])
        assert not await ours.validate_request(unsigned)

        fresh = dht_pb2.StoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1.0])
        await ours.sign_request(fresh)
        response = dht_pb2.StoreResponse(store_ok=[True])
        await ours_too.sign_response(response, fresh)
        assert await ours.validate_response(response, fresh)
        await theirs.sign_response(response, fresh)
        assert not await ours.validate_response(response, fresh)

    asyncio.run(scenario())
