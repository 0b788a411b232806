"""Diagnostics.Probe is served to unsigned callers in an open swarm, so it must not be a port
scanner. Found by a hostile-peer audit: `detail` was gRPC's raw connect error ("Failed to
connect", "Failed parsing HTTP/2", "Socket closed"), which told a closed port from an HTTP server,
and `address` took gRPC's target schemes (`unix:/etc/passwd:1`, `unix-abstract:foo:1`, `dns:`,
`ipv4:`), so the node dialled unix sockets on its own host. Now: a plain host:port only, and one
fixed word after the same time for every failure."""

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from noloco_node.rpc import diagnostics
from noloco_node.rpc.diagnostics import DiagnosticsServicer, grpc_target, valid_address
from noloco_node.wire.v1 import diag_pb2

TIMEOUT_S = 0.6


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details: str):
        self.code, self.details = code, details
        raise Aborted(details)


def servicer() -> DiagnosticsServicer:
    return DiagnosticsServicer(run_id="r", version="v", manifest_hash="m", timeout_s=TIMEOUT_S)


async def probe(address: str) -> diag_pb2.ProbeReply:
    return await servicer().Probe(diag_pb2.ProbeRequest(run_id="r", address=address), Context())


@pytest.mark.parametrize(
    "address",
    [
        "unix:/etc/passwd:1",
        "unix-abstract:foo:1",
        "ipv4:127.0.0.1:47020",
        "ipv6:[::1]:47020",
        "dns:localhost:47002",
        "dns:///localhost:47002",
        "vsock:1:2",
        "::1:5000",  # IPv6 without brackets
        "[fe80::1%eth0]:5000",  # a zone names a local interface
        "[127.0.0.1]:5000",
        "exa mple.org:1",
        "-bad.example.org:1",
        "1.2.3:5000",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:80\n",
        "a" * 250 + ":1",
    ],
)
async def test_only_a_plain_host_port_is_dialled(address, monkeypatch):
    async def never(*args, **kwargs):
        raise AssertionError(f"{address!r} was dialled")

    monkeypatch.setattr(diagnostics, "health_check", never)
    context = Context()
    with pytest.raises(Aborted):
        await servicer().Probe(diag_pb2.ProbeRequest(run_id="r", address=address), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("address ")
    assert not valid_address(address)


@pytest.mark.parametrize(
    "address,target",
    [
        ("127.0.0.1:5000", "ipv4:127.0.0.1:5000"),
        ("[::1]:5000", "ipv6:[::1]:5000"),
        ("node-1.example.org:5000", "dns:///node-1.example.org:5000"),
        ("stage_0:5000", "dns:///stage_0:5000"),  # a Compose service name
        ("unix:5000", "dns:///unix:5000"),  # a host named like a scheme stays a host name
    ],
)
def test_a_valid_address_is_dialled_with_its_scheme_spelled_out(address, target):
    assert valid_address(address) and grpc_target(address) == target


async def _listener(behaviour: str) -> asyncio.Server:
    """A TCP port that answers like an HTTP/1 server ("http") or accepts and says nothing ("silent")."""
    held = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if behaviour == "http":
            await reader.read(1024)
            writer.write(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
        else:
            held.append(writer)

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _health_server(status) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _timed(address: str) -> tuple[diag_pb2.ProbeReply, float]:
    start = asyncio.get_running_loop().time()
    reply = await probe(address)
    return reply, asyncio.get_running_loop().time() - start


async def test_a_failed_probe_says_one_word_after_the_whole_timeout():
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    listeners = {b: await _listener(b) for b in ("http", "silent")}
    ports = {"closed": closed_port, **{b: s.sockets[0].getsockname()[1] for b, s in listeners.items()}}
    try:
        answers = {kind: await _timed(f"127.0.0.1:{port}") for kind, port in ports.items()}
    finally:
        for server in listeners.values():
            server.close()
    for kind, (reply, seconds) in answers.items():
        assert not reply.reachable and reply.detail == "unreachable", (kind, reply.detail)
        assert TIMEOUT_S - 0.05 <= seconds < TIMEOUT_S + 0.5, (kind, seconds)
        assert reply.rtt_s >= TIMEOUT_S - 0.05, (kind, reply.rtt_s)


async def test_a_health_service_is_reachable_or_not_serving_at_once():
    for status, word in [
        (health_pb2.HealthCheckResponse.SERVING, "reachable"),
        (health_pb2.HealthCheckResponse.NOT_SERVING, "not serving"),
    ]:
        server, port = await _health_server(status)
        try:
            reply, seconds = await _timed(f"localhost:{port}")
        finally:
            await server.stop(None)
        assert reply.reachable is (word == "reachable") and reply.detail == word
        assert seconds < TIMEOUT_S, seconds


async def test_a_failures_wait_holds_no_probe_slot():
    """The wait to the end of the timeout only delays the answer: the 4 slots bound dials, and an
    honest joiner is not refused while earlier failures sit out their time."""
    closed = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    node = servicer()
    waiting = [
        asyncio.create_task(node.Probe(diag_pb2.ProbeRequest(run_id="r", address=address), Context())) for _ in range(4)
    ]
    await asyncio.sleep(TIMEOUT_S / 3)  # refused in milliseconds; now sitting out the timeout
    assert not node._slots.locked() and not any(w.done() for w in waiting)
    fifth = await node.Probe(diag_pb2.ProbeRequest(run_id="r", address=address), Context())
    assert fifth.detail == "unreachable" and [(await w).detail for w in waiting] == ["unreachable"] * 4
