"""The WAN relay on loopback: measured RTT and throughput match the profile within 15%, and a
real gRPC health call (over TLS, pinning the server's certificate) through it pays the round trip."""

import asyncio
import time

import pytest

from noloco_node.netem.relay import LinkProfile, Relay
from noloco_node.netem.selfcheck import measure_link

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_relay_matches_the_profile_within_15_percent():
    measured = asyncio.run(measure_link(LinkProfile("wan", one_way_ms=25, mbit=50)))
    print(f"profile 50 ms RTT / 50 Mbit/s: measured {measured['rtt_ms']:.1f} ms, {measured['mbit']:.1f} Mbit/s")
    assert measured["rtt_ms"] == pytest.approx(50.0, rel=0.15), measured
    assert measured["mbit"] == pytest.approx(50.0, rel=0.15), measured


def test_jitter_never_goes_below_the_base_latency_and_keeps_order():
    measured = asyncio.run(measure_link(LinkProfile("jitter", one_way_ms=20, jitter_ms=5, mbit=0), pings=21))
    assert 30.0 <= measured["rtt_ms"] <= 50.0 * 1.15, measured  # readexactly would fail on reordering


def test_grpc_health_through_the_relay_pays_the_round_trip():
    from noloco_node.rpc.diagnostics import health_check
    from noloco_node.rpc.server import NodeServer
    from noloco_node.transport.tls import NodeCertificate

    async def scenario():
        cert = NodeCertificate.generate()
        server = NodeServer("127.0.0.1", 0, credentials=cert.server_credentials())
        port = await server.start()
        relay = Relay(f"127.0.0.1:{port}", LinkProfile("wan", one_way_ms=30, mbit=20))
        await relay.start()
        try:
            await health_check(relay.address, 10, cert.cert_pem)  # connection set-up (several round trips)
            start = time.perf_counter()
            serving, detail, _ = await health_check(relay.address, 10, cert.cert_pem)
            return serving, detail, time.perf_counter() - start
        finally:
            await relay.close()
            await server.stop(0.1)

    serving, detail, seconds = asyncio.run(scenario())
    assert serving, detail
    assert seconds >= 0.060  # at least one 60 ms round trip (a new channel per call, with its TLS handshake: more)
