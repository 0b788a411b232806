"""The relay splice's request format and the parsing of relays from a record's circuit addresses."""

import asyncio

import pytest

from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.relay import RelayRefused, encode_request, parse_request, read_line, relays_of


def _read_line(data: bytes) -> bytes:
    async def read() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_line(reader, 1.0)

    return asyncio.run(read())


def test_request_round_trip():
    peer = NodeIdentity.generate().peer_id
    assert parse_request(_read_line(encode_request(peer))) == peer


@pytest.mark.parametrize("line", [b"GET / HTTP/1.1", b"NLR1 not-a-peer-id", b"NLR1 ", b"NLR1 \xff\xfe"])
def test_malformed_requests_are_refused(line):
    with pytest.raises(RelayRefused):
        parse_request(line)


def test_request_lines_are_bounded():
    with pytest.raises(RelayRefused, match="line of"):
        _read_line(b"NLR1 " + b"x" * 500 + b"\n")
    with pytest.raises(RelayRefused, match="no complete line"):
        _read_line(b"NLR1 abc")  # the stream ends before a newline


def test_relays_of_reads_circuit_addresses():
    relay, target = NodeIdentity.generate().peer_id, NodeIdentity.generate().peer_id
    addrs = [
        f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}/p2p-circuit/p2p/{target}",
        "/ip4/198.18.0.5/tcp/4001",
        f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}",
    ]
    assert relays_of(addrs) == [(relay, f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}")]
    assert relays_of([]) == []


class _Info:
    def __init__(self, peer_id: str) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(peer_id)


class _FakeP2P:
    """Stands in for hivemind.P2P: the relay's connected peers, and targets that echo."""

    def __init__(self, me: str, connected: list[str]) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(me)
        self.connected = connected
        self.opened: list[str] = []

    async def list_peers(self):
        return [_Info(p) for p in self.connected]

    async def call_binary_stream_handler(self, peer, protocol):
        self.opened.append(peer.to_base58())
        return None, *(await _pipe_to(_echo))


async def _echo(reader, writer):
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


_TASKS: set = set()  # the event loop keeps only weak references to tasks


async def _pipe_to(handler):
    """A (reader, writer) whose other end is served by `handler`."""
    import socket

    ours, theirs = socket.socketpair()
    their_reader, their_writer = await asyncio.open_connection(sock=theirs)
    task = asyncio.ensure_future(handler(their_reader, their_writer))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
    return await asyncio.open_connection(sock=ours)


def test_relay_splices_and_bounds_circuits():
    from noloco_node.transport.relay import RelayService

    relay_id, caller, other, target, stranger = (NodeIdentity.generate().peer_id for _ in range(5))

    async def scenario():
        p2p = _FakeP2P(relay_id, connected=[caller, target])
        service = RelayService(p2p, max_per_source=2, max_circuits=8, connect_timeout_s=2.0)
        answers, open_streams = [], []

        async def dial(name: str, who: str):
            async def serve(reader, writer):
                await service._on_stream(_Info(who), reader, writer)

            reader, writer = await _pipe_to(serve)
            writer.write(encode_request(name))
            await writer.drain()
            answers.append(await read_line(reader, 2.0))
            open_streams.append((reader, writer))
            return reader, writer

        reader, writer = await dial(target, caller)
        writer.write(b"ping")
        await writer.drain()
        echoed = await asyncio.wait_for(reader.readexactly(4), 2.0)
        await dial(target, caller)
        await dial(target, caller)  # a third circuit from the same caller: over max_per_source
        await dial(stranger, other)  # not connected to the relay
        await dial(relay_id, other)  # the relay itself
        stats = service.stats()
        for _, w in open_streams:
            w.close()
        return echoed, answers, stats, p2p.opened

    echoed, answers, stats, opened = asyncio.run(scenario())
    assert echoed == b"ping"
    assert answers[:2] == [b"OK", b"OK"]
    assert answers[2].startswith(b"NO relay busy"), answers
    assert answers[3].startswith(b"NO") and b"not connected" in answers[3], answers
    assert answers[4].startswith(b"NO"), answers
    assert opened == [target, target]  # refused circuits never open a stream to anyone
    assert stats["circuits_total"] == 2 and stats["bytes_relayed"] >= 8
    assert stats["refused"] == {"busy": 1, "not_connected": 1, "malformed": 1}, stats
