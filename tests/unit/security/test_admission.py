"""Swarm-key tokens, the per-peer guard and the DHT authorizer, without a network."""

import asyncio

import pytest
from hivemind.proto import dht_pb2

from noloco_node.dht.auth import SwarmKeyAuthorizer
from noloco_node.rpc.admission import (AUTH_HEADER, PEER_HEADER, ClientIdentity, SwarmKeyError, load_swarm_key,
                                       make_token, verify_token)
from noloco_node.rpc.guard import PeerGuard

KEY, OTHER = b"k" * 32, b"o" * 32
METHOD = "/noloco.wire.v1.Stage/Forward"


def test_token_round_trip_names_the_peer():
    assert verify_token(KEY, make_token(KEY, "peerA", METHOD), METHOD, max_skew_s=5) == "peerA"


# Tokens are made inside the test (not at collection, which may be minutes earlier than the run).
@pytest.mark.parametrize("make, why", [
    (lambda: None, "no swarm-key token"),
    (lambda: "garbage", "malformed"),
    (lambda: "peerA.notanumber.00", "malformed"),
    (lambda: make_token(OTHER, "peerA", METHOD), "not made with this swarm's key"),
    (lambda: make_token(KEY, "peerA", "/noloco.wire.v1.Outer/Exchange"), "not made with this swarm's key"),
    (lambda: make_token(KEY, "peerA", METHOD, now=1_000.0), "from ours"),
], ids=["missing", "garbage", "bad-stamp", "other-key", "other-method", "stale"])
def test_bad_tokens_are_refused_with_the_reason(make, why):
    with pytest.raises(SwarmKeyError, match=why):
        verify_token(KEY, make(), METHOD, max_skew_s=60)


def test_a_forged_peer_id_breaks_the_mac():
    peer, stamp, mac = make_token(KEY, "peerA", METHOD).split(".")
    with pytest.raises(SwarmKeyError, match="not made with"):
        verify_token(KEY, f"peerB.{stamp}.{mac}", METHOD, max_skew_s=60)


def test_skew_inside_the_bound_is_accepted():
    import time

    token = make_token(KEY, "peerA", METHOD, now=time.time() - 30)
    assert verify_token(KEY, token, METHOD, max_skew_s=60) == "peerA"


def test_client_identity_headers():
    assert ClientIdentity(None, "p1").metadata(METHOD) == [(PEER_HEADER, "p1")]
    [(name, value)] = ClientIdentity(KEY, "p1").metadata(METHOD)
    assert name == AUTH_HEADER and verify_token(KEY, value, METHOD, 5) == "p1"


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
    args = dict(requests_per_s=10, burst=3, max_streams=2, ban_after_invalid=2, ban_s=10, ban_max_s=25, clock=clock)
    args.update(kw)
    return PeerGuard(**args)


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
