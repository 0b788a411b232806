"""Stage-RPC throughput and small-call latency of the node's transports on 127.0.0.1, each as a
ratio to raw TCP measured in the same run (the machine is shared and noisy).

The server side is one separate process, as a peer would be; the client side is this process.
  raw TCP          a socket pair in two processes: `sendall` of 1 MiB slices into `recv_into` a
                   preallocated buffer, an 8-byte ack per message: the baseline every transport
                   is a ratio to
  gRPC direct TLS  a real NodeServer with the node's self-signed certificate and the admission
                   interceptor (every call's signature checked), serving the real Stage.Forward
                   (StageServicer, whose handler drops the tensor); the client is what nodes use:
                   StageClient -> Dialer -> open_channel, the certificate pinned, every call signed
    ..., sink servicer  the same messages on the same kind of channel to a servicer registered on
                   the same NodeServer that only counts them: the transport without the Stage
                   servicer's validation (copy, SHA-256, decode, finiteness check)
  gRPC/libp2p direct   the same calls carried by Libp2pBridge over a direct libp2p connection
                   between two p2pd (what a successful hole punch gives)
  gRPC/libp2p relayed  the same through a circuit relay: the server's daemon is private, with
                   auto-relay and the relays trusted; the client dials <relay>/p2p-circuit/p2p/<id>
  hivemind P2P     the alternative design: the same ForwardMessage stream sent with hivemind's
                   add_protobuf_handler(stream_input=True) / call_protobuf_handler over the direct
                   libp2p connection into the same StageServicer.Forward (no per-call signature)

Throughput: one Forward of a --mib MiB float32 tensor (codec none, 1 MiB chunks), timed from the
call to the server's ack (client encode included, as in a node); --repeats rounds after a
warm-up, round-robin over the transports, median. Latency: a Forward of a --small-kib KiB
tensor, --iters calls per transport in interleaved blocks, p50/p99.

Relayed needs a private network namespace. On loopback libp2p upgrades a relayed connection to a
direct one at once (the client learns the server's listen address over the relay and dials it), so
the benchmark re-runs itself under `unshare --net` (root, util-linux, iptables) and rejects new
TCP connections to the private server daemon's port there; the namespace and its rule vanish with
the run. The server's private daemon is started as joining.settle_reach starts a node behind NAT
(force_reachability=private, auto-relay, the relays trusted, relayDiscovery=0); the client's daemon
has no listen address, so the server's hole punch has nothing to reach. Without a namespace the
relayed row says where its traffic really went. A relay may cut a circuit after ~128 KiB (it did
in some runs here and not in others): the relayed row then shows FAILED and how many bytes got
through, since a node's calls would fail the same way.

    .venv/bin/python benchmarks/transport.py [--mib 64] [--repeats 7] [--iters 400] [--quick]
        [--json FILE] [--netns auto|on|off] [--relays 1] [--relay-wait-s 45] [--wait-idle-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 1 << 20
RUN_ID, MANIFEST = "bench-transport", "bench"
P2P_FORWARD = "/noloco-bench/forward/1"
SINK_METHOD = "/noloco.bench.Sink/Forward"
NETNS_ENV = "NOLOCO_BENCH_TRANSPORT_NETNS"
TARGETS = [
    ("grpc_tls", 0.50, "direct TLS throughput >= 50% of raw TCP"),
    ("libp2p_relayed", 0.10, "relayed (swarm relay) throughput >= 10% of raw TCP"),
]
LABELS = {
    "raw_tcp": "raw TCP (socket pair)",
    "grpc_tls": "gRPC direct TLS",
    "grpc_tls_sink": "gRPC direct TLS, sink servicer",
    "libp2p_direct": "gRPC over libp2p, direct",
    "libp2p_relayed": "TLS gRPC via swarm relay",
    "libp2p_circuit": "gRPC over p2pd circuit",
    "hivemind_p2p": "hivemind P2P protobuf stream",
}


def _short(exc: BaseException, n: int = 160) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU clock ticks of the whole machine so far, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(values) - values[3] - values[4], sum(values)


def _tree_ticks(root: int) -> int:
    """CPU clock ticks used so far by `root` and its descendants (reaped children included)."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    total = 0
    for pid in ticks:
        walk = pid
        while walk not in (0, 1, root) and walk in parents:
            walk = parents[walk]
        if walk == root:
            total += ticks[pid]
    return total


class LoadMeter:
    """How busy the machine was with work other than this benchmark's processes."""

    def __init__(self) -> None:
        self.start = _machine_ticks(), _tree_ticks(os.getpid())

    def foreign_fraction(self) -> float | None:
        end = _machine_ticks(), _tree_ticks(os.getpid())
        if self.start[0] is None or end[0] is None or end[0][1] <= self.start[0][1]:
            return None
        busy = end[0][0] - self.start[0][0]
        ours = end[1] - self.start[1]
        return max(0.0, (busy - ours) / (end[0][1] - self.start[0][1]))


def wait_until_quiet(max_s: float, busy_below: float = 0.25) -> str:
    """Wait (at most `max_s`) for a second in which the machine is less than `busy_below` busy."""
    deadline, busy = time.monotonic() + max_s, None
    while True:
        before = _machine_ticks()
        time.sleep(1.0)
        after = _machine_ticks()
        if before is None or after is None or after[1] <= before[1]:
            return "machine load unknown"
        busy = (after[0] - before[0]) / (after[1] - before[1])
        if busy < busy_below:
            return f"machine {busy:.0%} busy at the start"
        if time.monotonic() >= deadline:
            return f"machine still {busy:.0%} busy after waiting {max_s:.0f} s for it to quieten; started anyway"


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            return False
        got += n
    return True


# ---- raw TCP receiver (child process) -------------------------------------------------------
def raw_tcp_receiver(pipe, max_bytes: int) -> None:
    from noloco_node.runtime.memory import tune_allocator

    tune_allocator()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(120)
        pipe.send(srv.getsockname()[1])
        conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        buf, header = memoryview(bytearray(max_bytes)), memoryview(bytearray(8))
        while _recv_exact(conn, header):
            n = int.from_bytes(header, "little")
            if not _recv_exact(conn, buf[:n]):
                break
            conn.sendall(n.to_bytes(8, "little"))


class RawTcp:
    def __init__(self, port: int, max_bytes: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.payload = memoryview(bytearray(max_bytes))
        self.ack = memoryview(bytearray(8))

    def send(self, n: int) -> None:
        header = n.to_bytes(8, "little")
        if n <= CHUNK:
            self.sock.sendall(header + self.payload[:n])
        else:
            self.sock.sendall(header)
            for start in range(0, n, CHUNK):
                self.sock.sendall(self.payload[start : min(n, start + CHUNK)])
        if not _recv_exact(self.sock, self.ack) or int.from_bytes(self.ack, "little") != n:
            raise ConnectionError("raw TCP receiver did not acknowledge")

    def close(self) -> None:
        self.sock.close()


# ---- the server peer (child process) --------------------------------------------------------
class _Sink:
    """A StageHandler that admits everything and drops the tensor."""

    def admit_forward(self, header, spec):
        return header.microbatch.sequence

    def release_forward(self, ticket) -> None:
        pass

    async def accept_forward(self, ticket, activations) -> None:
        pass


class _P2PContext:
    """What StageServicer.Forward uses of a gRPC context, for the hivemind P2P path."""

    async def abort(self, code, details: str):
        raise RuntimeError(f"{code.name}: {details}")


def _private_daemon_class(discovery: bool):
    """hivemind.P2P whose p2pd runs with relayDiscovery=0, as a node behind NAT starts it (or
    with p2pd's default, relay discovery on, if `discovery`)."""
    from noloco_node.dht.daemon import daemon_with_flags

    return daemon_with_flags({} if discovery else {"relayDiscovery": False})


def server_process(pipe, opts: dict) -> None:
    os.setsid()  # its own process group: the parent can always end it together with its p2pd
    asyncio.run(_serve(pipe, opts))


async def _sink_forward(request_iterator, context):
    """The same ForwardMessage stream, counted and dropped: what the transport alone costs."""
    from noloco_node.wire.v1 import stage_pb2

    received = 0
    async for message in request_iterator:
        if message.WhichOneof("kind") == "chunk":
            received += len(message.chunk.data)
    return stage_pb2.StageAck(bytes_received=received)


async def _serve(pipe, opts: dict) -> None:
    import grpc
    from hivemind.p2p import P2P

    from noloco_node.rpc.admission import AdmissionInterceptor
    from noloco_node.rpc.guard import GuardLimits, PeerGuard
    from noloco_node.rpc.server import NodeServer
    from noloco_node.rpc.checks import ServedRun
    from noloco_node.rpc.stage_service import GRPC_OPTIONS, StageServicer
    from noloco_node.runtime.memory import tune_allocator
    from noloco_node.transport.bridge import Libp2pBridge
    from noloco_node.transport.identity import NodeIdentity
    from noloco_node.transport.links import Links
    from noloco_node.wire.v1 import stage_pb2

    tune_allocator()
    links = Links(NodeIdentity.generate(), swarm_key=None, max_skew_s=60.0, options=GRPC_OPTIONS)
    extra: list[Libp2pBridge] = []

    def bridged(grpc_peer: str):
        found = links.origin(grpc_peer)
        for bridge in extra:
            found = found or bridge.origin(grpc_peer)
        return found

    guard = PeerGuard(
        GuardLimits(requests_per_s=1e6, burst=10**6, max_streams=64, ban_after_invalid=10**6, ban_s=1.0, ban_max_s=1.0)
    )
    refusals: list[str] = []

    class RecordingAdmission(AdmissionInterceptor):  # what each refusal said
        def _prove(self, method, context):
            try:
                return super()._prove(method, context)
            except Exception as exc:
                refusals.append(_short(exc, 200))
                raise

    admission = RecordingAdmission(verifier=links.verifier, swarm_key=None, guard=guard, bridged=bridged)
    server = NodeServer("127.0.0.1", 0, credentials=links.certificate.server_credentials(), admission=admission)
    servicer = StageServicer(
        _Sink(), run=ServedRun(RUN_ID, MANIFEST), max_payload_bytes=opts["max_bytes"], receive_s=30.0
    )
    server.add_stage(servicer)
    rejections: list[str] = []
    abort = servicer._abort

    async def recording_abort(context, method: str, error) -> None:  # what each rejection said
        rejections.append(_short(error, 200))
        await abort(context, method, error)

    servicer._abort = recording_abort
    server.server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "noloco.bench.Sink",
                {
                    "Forward": grpc.stream_unary_rpc_method_handler(
                        _sink_forward,
                        request_deserializer=stage_pb2.ForwardMessage.FromString,
                        response_serializer=stage_pb2.StageAck.SerializeToString,
                    )
                },
            ),
        )
    )
    daemons: list = []
    private = None
    try:
        port = await server.start()
        direct = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=links.identity.identity_path(),
            check_if_identity_free=False,
        )
        daemons.append(direct)
        await links.attach(direct, server.bridge_port)

        async def p2p_forward(requests, context):
            return await servicer.Forward(requests, _P2PContext())

        await direct.add_protobuf_handler(P2P_FORWARD, p2p_forward, stage_pb2.ForwardMessage, stream_input=True)
        info = {
            "peer_id": links.peer_id,
            "tls_address": f"127.0.0.1:{port}",
            "tls_cert": links.certificate.b64,
            "direct_maddrs": [str(m) for m in await direct.get_visible_maddrs()],
        }
        if opts["relays"]:
            # As joining.settle_reach restarts a node that cannot be dialled: private, auto-relay,
            # the relays trusted and static (p2pd's relayDiscovery=0, else it waits 3 min for more).
            private = await _private_daemon_class(opts["relay_discovery"]).create(
                host_maddrs=[f"/ip4/127.0.0.1/tcp/{opts['private_port']}"],
                identity_path=links.identity.identity_path(),
                check_if_identity_free=False,
                force_reachability="private",
                use_auto_relay=True,
                trusted_relays=opts["relays"],
                initial_peers=opts["relays"],
            )
            daemons.append(private)
            bridge = Libp2pBridge(private, traffic=links.traffic)
            await bridge.serve(server.bridge_port, server.tls_target)
            extra.append(bridge)
        pipe.send(("ready", info))
        while True:
            if not await asyncio.to_thread(pipe.poll, 0.5):
                if os.getppid() != opts["parent_pid"]:
                    break  # the parent is gone
                continue
            message = pipe.recv()
            if message == "stop":
                break
            if message == "stats":
                stats = {
                    "traffic": links.traffic.as_dict(),
                    "refused": dict(admission.refused),
                    "rejected": dict(servicer.rejected),
                    "rejections": rejections[-5:],
                    "refusals": refusals[-5:],
                    "bytes_received": servicer.bytes_received,
                    "streams_in": [b.streams_in for b in [links.bridge, *extra] if b is not None],
                }
                if private is not None:
                    stats["private_visible"] = [str(m) for m in await private.get_visible_maddrs(latest=True)]
                    stats["private_peers"] = {
                        p.peer_id.to_base58(): [str(a) for a in p.addrs] for p in await private.list_peers()
                    }
                pipe.send(("stats", stats))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        try:
            pipe.send(("error", _short(exc, 400)))
        except (OSError, ValueError):
            pass
    finally:
        for bridge in extra:
            await bridge.close()
        await links.close()
        await server.stop(0.5)
        for daemon in daemons:
            await daemon.shutdown()


# ---- client-side paths ----------------------------------------------------------------------
class Transport:
    def __init__(self, key: str) -> None:
        self.key, self.label = key, LABELS[key]
        self.bulk_s: list[float] = []
        self.lat_s: list[float] = []
        self.error: str | None = None  # set up failed: nothing measured
        self.bulk_error: str | None = None
        self.small_error: str | None = None
        self.notes: list[str] = []
        self.route = ""

    async def call(self, bulk: bool) -> None:
        raise NotImplementedError

    async def reset(self) -> None:
        """After a failed call: start the next ones on a fresh connection."""


class RawPath(Transport):
    def __init__(self, raw: RawTcp, bulk_bytes: int, small_bytes: int) -> None:
        super().__init__("raw_tcp")
        self.raw, self.sizes = raw, {True: bulk_bytes, False: small_bytes}
        self.route = "TCP 127.0.0.1"

    async def call(self, bulk: bool) -> None:
        self.raw.send(self.sizes[bulk])  # blocking on purpose: nothing else should run meanwhile


class StagePath(Transport):
    """Stage.Forward exactly as a node sends it: StageClient over a Dialer's channel."""

    def __init__(self, key: str, client, server_id: str, client_id: str, tensors: dict) -> None:
        super().__init__(key)
        self.client, self.server_id, self.client_id, self.tensors = client, server_id, client_id, tensors
        self.seq = 0

    async def reset(self) -> None:
        await self.client.dialer.close()  # a channel that saw a failure sits in reconnect backoff
        self.client = _stage_client(self.client.dialer, self.client.timeout_s)

    async def call(self, bulk: bool) -> None:
        import torch

        from noloco_node.wire.v1 import stage_pb2

        self.seq += 1
        await self.client.forward(
            self.server_id,
            microbatch=stage_pb2.MicrobatchId(origin_peer=self.client_id, sequence=self.seq),
            route=[stage_pb2.Hop(peer_id=self.client_id, address="", stage=0)],
            target_stage=1,
            activations=self.tensors[bulk],
            labels=torch.zeros(0, dtype=torch.int64),
        )


class HivemindPath(Transport):
    """The same ForwardMessage stream (StageClient.forward's messages) over hivemind's P2P handlers."""

    def __init__(self, p2p, server_id: str, client_id: str, tensors: dict) -> None:
        super().__init__("hivemind_p2p")
        from hivemind.p2p import PeerID

        self.p2p, self.peer, self.client_id, self.tensors = p2p, PeerID.from_base58(server_id), client_id, tensors
        self.seq = 0

    async def call(self, bulk: bool) -> None:
        from noloco_node.wire.v1 import stage_pb2

        self.seq += 1
        messages, size = _forward_messages(self.tensors[bulk], self.client_id, self.seq)

        async def stream():
            for message in messages:
                yield message

        ack = await self.p2p.call_protobuf_handler(self.peer, P2P_FORWARD, stream(), stage_pb2.StageAck)
        if ack.bytes_received != size:
            raise RuntimeError(f"ack for {ack.bytes_received} of {size} bytes")


class SinkPath(Transport):
    """StageClient.forward's messages on the same signed TLS channel, to a servicer that only
    counts them: the transport's share of the Stage row."""

    def __init__(self, dialer, server_id: str, client_id: str, tensors: dict, timeout_s: float) -> None:
        super().__init__("grpc_tls_sink")
        self.dialer, self.server_id, self.client_id, self.tensors = dialer, server_id, client_id, tensors
        self.timeout_s, self.seq = timeout_s, 0

    async def call(self, bulk: bool) -> None:
        from noloco_node.wire.v1 import stage_pb2

        self.seq += 1
        messages, size = _forward_messages(self.tensors[bulk], self.client_id, self.seq)
        channel, _ = await self.dialer.channel(self.server_id)
        method = channel.stream_unary(
            SINK_METHOD,
            request_serializer=stage_pb2.ForwardMessage.SerializeToString,
            response_deserializer=stage_pb2.StageAck.FromString,
        )
        ack = await method(iter(messages), timeout=self.timeout_s)
        if ack.bytes_received != size:
            raise RuntimeError(f"ack for {ack.bytes_received} of {size} bytes")

    async def reset(self) -> None:
        await self.dialer.close()


def _forward_messages(tensor, client_id: str, seq: int) -> tuple[list, int]:
    """The messages StageClient.forward sends for `tensor` (header, then 1 MiB chunks)."""
    from noloco_node.rpc.tensors import encode_tensor, iter_chunks
    from noloco_node.wire.v1 import stage_pb2, tensor_pb2

    tensor_header, payload = encode_tensor(tensor, "none")
    header = stage_pb2.ForwardHeader(
        run=tensor_pb2.RunIdentity(run_id=RUN_ID, manifest_hash=MANIFEST),
        microbatch=stage_pb2.MicrobatchId(origin_peer=client_id, sequence=seq),
        route=[stage_pb2.Hop(peer_id=client_id, address="", stage=0)],
        activations=tensor_header,
        labels=[],
        target_stage=1,
    )
    messages = [stage_pb2.ForwardMessage(header=header)]
    messages += [stage_pb2.ForwardMessage(chunk=c) for c in iter_chunks(payload)]
    return messages, len(payload)


def _stage_client(dialer, timeout_s: float):
    from noloco_node.rpc.stage_service import StageClient, StageCodecs

    return StageClient(
        run_id=RUN_ID, manifest_hash=MANIFEST, codecs=StageCodecs("none"), timeout_s=timeout_s, dialer=dialer
    )


def _dialer(signer, contact, bridge=None, circuit: bool = False):
    """The product's Dialer; with `circuit`, one that never takes the swarm relay, so a relayed
    contact is dialled through p2pd's own circuit relay (for comparison)."""
    from noloco_node.rpc.stage_service import GRPC_OPTIONS
    from noloco_node.transport.dialer import Dialer

    async def lookup(peer_id: str):
        return contact if peer_id == contact.peer_id else None

    class CircuitDialer(Dialer):
        async def via_relay(self, contact) -> bool:
            return False

    return (CircuitDialer if circuit else Dialer)(signer, lookup=lookup, bridge=bridge, options=GRPC_OPTIONS)


async def _bridged_path(
    key: str, p2p, bridge, signer, contact, client_id: str, tensors: dict, timeout_s: float, circuit: bool = False
) -> StagePath:
    """A StagePath over `bridge`, first exactly as a node dials (Dialer -> Libp2pBridge.endpoint
    with the record's addresses); if that call fails, the daemon is connected with a correctly
    encoded address (DaemonMaddr) and the call retried, and the note says so."""
    from hivemind.p2p import PeerID

    from noloco_node.transport.bridge import DaemonMaddr
    from hivemind.utils.multiaddr import Multiaddr

    dialer = _dialer(signer, contact, bridge, circuit)
    path = StagePath(key, _stage_client(dialer, timeout_s), contact.peer_id, client_id, tensors)
    peer = PeerID.from_base58(contact.peer_id)
    try:
        await asyncio.wait_for(path.call(False), 25)
        return path
    except Exception as exc:  # noqa: BLE001 - diagnosed below
        first = _short(exc)
    try:  # what Libp2pBridge._open does with the record's addresses (it logs failures at DEBUG only)
        await asyncio.wait_for(p2p._client.connect(peer, [Multiaddr(a) for a in contact.p2p_addrs]), 15)
        how = "the bridge's own connect() with them succeeded"
    except Exception as exc:  # noqa: BLE001
        how = f"the bridge's connect() with them fails in p2pd: {_short(exc, 120)}"
    path.notes.append(
        f"first call as a node makes it failed ({first}); record addresses {list(contact.p2p_addrs)}: "
        f"{how}; connected the daemon with DaemonMaddr and retried"
    )
    await asyncio.wait_for(p2p._client.connect(peer, [DaemonMaddr(a) for a in contact.p2p_addrs]), 20)
    await dialer.close()  # the channel that saw the failure is in reconnect backoff
    path.client = _stage_client(dialer, timeout_s)
    await asyncio.wait_for(path.call(False), 25)
    return path


async def _wait_for_reservation(server_id: str, circuits: list[str], wait_s: float) -> tuple[str | None, str]:
    """The first circuit address a fresh, non-listening daemon can connect through (fresh each
    try, so the real client starts without dial backoff), or None and the last error."""
    from hivemind.p2p import P2P, PeerID

    from noloco_node.transport.bridge import DaemonMaddr

    deadline, last = time.monotonic() + wait_s, ""
    peer = PeerID.from_base58(server_id)
    while time.monotonic() < deadline:
        for circuit in circuits:
            probe = await P2P.create(host_maddrs=[], no_listen=True)
            try:
                await asyncio.wait_for(probe._client.connect(peer, [DaemonMaddr(circuit)]), 10)
                return circuit, ""
            except Exception as exc:  # noqa: BLE001
                last = _short(exc, 200)
            finally:
                await probe.shutdown()
        await asyncio.sleep(0.5)
    return None, last


async def _peer_addrs(p2p, peer_id: str) -> list[str]:
    for info in await p2p.list_peers():
        if info.peer_id.to_base58() == peer_id:
            return [str(a) for a in info.addrs]
    return []


def _request(pipe, message: str, timeout_s: float):
    pipe.send(message)
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"server process did not answer {message!r} in {timeout_s:.0f} s")
    return pipe.recv()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def run(args) -> dict:
    import torch
    from hivemind.p2p import P2P

    from noloco_node.dht.daemon import daemon_with_flags
    from noloco_node.runtime.memory import tune_allocator
    from noloco_node.transport.bridge import Libp2pBridge
    from noloco_node.transport.credentials import CallSigner
    from noloco_node.transport.relay import RelayService
    from noloco_node.transport.dialer import Contact
    from noloco_node.transport.identity import NodeIdentity

    in_netns = os.environ.get(NETNS_ENV) == "1"
    tuned = tune_allocator()
    bulk_bytes, small_bytes = args.mib << 20, args.small_kib << 10
    tensors = {
        True: torch.randn(bulk_bytes // 4096, 1024, generator=torch.Generator().manual_seed(0)),
        False: torch.randn(small_bytes // 4096, 1024, generator=torch.Generator().manual_seed(1)),
    }
    ctx = mp.get_context("spawn")
    procs: list = []
    daemons: list = []
    closers: list = []
    paths: list[Transport] = []
    notes: list[str] = []
    raw = None
    identity = NodeIdentity.generate()
    quiet = wait_until_quiet(args.wait_idle_s) if args.wait_idle_s > 0 else "no wait for a quiet machine"
    print(
        f"payload {args.mib} MiB float32 in {CHUNK >> 20} MiB chunks x {args.repeats} repeats (+1 warm-up); latency "
        f"{args.small_kib} KiB Forward x {args.iters}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        "allocator "
        f"tuned={tuned}; network: {'private namespace (unshare --net)' if in_netns else 'host loopback'}; {quiet}",
        flush=True,
    )
    try:
        # raw TCP receiver
        raw_pipe, child_end = ctx.Pipe()
        proc = ctx.Process(target=raw_tcp_receiver, args=(child_end, bulk_bytes), daemon=True)
        proc.start()
        procs.append(proc)
        if not raw_pipe.poll(60):
            raise TimeoutError("raw TCP receiver did not start in 60 s")
        raw = RawTcp(raw_pipe.recv(), bulk_bytes)
        paths.append(RawPath(raw, bulk_bytes, small_bytes))

        # relays, then the server peer
        relay_maddrs: list[str] = []
        for _ in range(args.relays):
            relay = await daemon_with_flags(json.loads(args.relay_flags)).create(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], force_reachability="public"
            )
            daemons.append(relay)
            relay_maddrs.append(str((await relay.get_visible_maddrs())[0]))
            service = RelayService(relay)
            await service.start()
            closers.append(service.close)
        private_port = _free_port()
        if relay_maddrs and in_netns:  # only inside our own namespace: the rule dies with it
            subprocess.run(
                [
                    "iptables",
                    "-I",
                    "INPUT",
                    "-p",
                    "tcp",
                    "--dport",
                    str(private_port),
                    "--syn",
                    "-j",
                    "REJECT",
                    "--reject-with",
                    "tcp-reset",
                ],
                check=True,
                timeout=30,
            )
        server_pipe, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=server_process,
            args=(
                child_end,
                {
                    "max_bytes": bulk_bytes + CHUNK,
                    "relays": relay_maddrs,
                    "private_port": private_port,
                    "relay_discovery": args.relay_discovery,
                    "parent_pid": os.getpid(),
                },
            ),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
        if not server_pipe.poll(90):
            raise TimeoutError("server process did not start in 90 s")
        kind, info = server_pipe.recv()
        if kind != "ready":
            raise RuntimeError(f"server process failed: {info}")
        server_id = info["peer_id"]

        signer = CallSigner(identity)
        # direct TLS, exactly as a node dials a `direct` record
        tls_contact = Contact(server_id, info["tls_address"], "direct", info["tls_cert"])
        try:
            dialer = _dialer(signer, tls_contact)
            closers.append(dialer.close)
            path = StagePath(
                "grpc_tls", _stage_client(dialer, args.call_timeout_s), server_id, identity.peer_id, tensors
            )
            path.route = f"TLS {info['tls_address']}"
            await asyncio.wait_for(path.call(False), 25)
        except Exception as exc:  # noqa: BLE001
            path = Transport("grpc_tls")
            path.error = _short(exc)
        paths.append(path)
        try:
            sink_dialer = _dialer(signer, tls_contact)
            closers.append(sink_dialer.close)
            path = SinkPath(sink_dialer, server_id, identity.peer_id, tensors, args.call_timeout_s)
            path.route = f"TLS {info['tls_address']}, its own channel"
            await asyncio.wait_for(path.call(False), 25)
        except Exception as exc:  # noqa: BLE001
            path = Transport("grpc_tls_sink")
            path.error = _short(exc)
        paths.append(path)

        # libp2p, direct connection, and hivemind's own handlers on the same connection
        p2p_direct = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=identity.identity_path(), check_if_identity_free=False
        )
        daemons.append(p2p_direct)
        bridge_direct = Libp2pBridge(p2p_direct)
        closers.append(bridge_direct.close)
        try:
            contact = Contact(server_id, "", "holepunched", p2p_addrs=tuple(info["direct_maddrs"]))
            path = await _bridged_path(
                "libp2p_direct",
                p2p_direct,
                bridge_direct,
                signer,
                contact,
                identity.peer_id,
                tensors,
                args.call_timeout_s,
            )
            closers.append(path.client.dialer.close)
        except Exception as exc:  # noqa: BLE001
            path = Transport("libp2p_direct")
            path.error = _short(exc)
        paths.append(path)
        try:
            path = HivemindPath(p2p_direct, server_id, identity.peer_id, tensors)
            await asyncio.wait_for(path.call(False), 25)
        except Exception as exc:  # noqa: BLE001
            path = Transport("hivemind_p2p")
            path.error = _short(exc)
        paths.append(path)

        # through a relay: the swarm's own splice (the product path), and p2pd's circuit relay
        relayed_clients: dict[str, tuple] = {}
        if not relay_maddrs:
            for key in ("libp2p_relayed", "libp2p_circuit"):
                path = Transport(key)
                path.error = "not run (--relays 0)"
                paths.append(path)
        else:
            circuits = [f"{m}/p2p-circuit/p2p/{server_id}" for m in relay_maddrs]
            started = time.monotonic()
            circuit, last = await _wait_for_reservation(server_id, circuits, args.relay_wait_s)
            if circuit is not None:
                what = "reservation usable" if in_netns else "a probe connected (maybe directly: no namespace)"
                notes.append(f"relayed: {what} after {time.monotonic() - started:.1f} s via {circuit}")
            for key, contact in (
                ("libp2p_relayed", Contact(server_id, "", "relayed", info["tls_cert"], (circuit,))),
                ("libp2p_circuit", Contact(server_id, "", "relayed", p2p_addrs=(circuit,))),
            ):
                path = Transport(key)
                if circuit is None:
                    path.error = f"no relay reservation within {args.relay_wait_s:.0f} s ({last})"
                    paths.append(path)
                    continue
                # no listen address: the server's hole punch (a dial back to us) has nothing to reach
                p2p = await P2P.create(
                    host_maddrs=[], no_listen=True, identity_path=identity.identity_path(), check_if_identity_free=False
                )
                daemons.append(p2p)
                bridge = Libp2pBridge(p2p)
                closers.append(bridge.close)
                relayed_clients[key] = (p2p, bridge)
                try:
                    path = await _bridged_path(
                        key,
                        p2p,
                        bridge,
                        signer,
                        contact,
                        identity.peer_id,
                        tensors,
                        args.call_timeout_s,
                        circuit=key == "libp2p_circuit",
                    )
                    closers.append(path.client.dialer.close)
                except Exception as exc:  # noqa: BLE001
                    path = Transport(key)
                    path.error = _short(exc)
                paths.append(path)

        # measurements: round-robin, so that background load hits every transport alike
        meter = LoadMeter()
        active = [p for p in paths if p.error is None]
        for rep in range(args.repeats + 1):
            order = active[rep % len(active) :] + active[: rep % len(active)]
            for path in order:
                if path.bulk_error is not None:
                    continue
                start = time.perf_counter()
                try:
                    await asyncio.wait_for(path.call(True), args.call_timeout_s)
                except Exception as exc:  # noqa: BLE001
                    elapsed = time.perf_counter() - start
                    path.bulk_error = f"call {rep + 1} of {args.mib} MiB failed after {elapsed:.1f} s: {_short(exc)}"
                    try:
                        await asyncio.wait_for(path.reset(), 10)
                    except Exception:  # noqa: BLE001 - the small calls will say if the path is dead
                        pass
                    continue
                if rep > 0:
                    path.bulk_s.append(time.perf_counter() - start)

        async def small(path: Transport, keep: bool) -> None:
            start = time.perf_counter()
            try:
                await asyncio.wait_for(path.call(False), 30)
            except Exception as exc:  # noqa: BLE001
                path.small_error = (
                    f"{args.small_kib} KiB call failed after {len(path.lat_s)} timed calls: {_short(exc)}"
                )
                return
            if keep:
                path.lat_s.append(time.perf_counter() - start)

        block = 50
        for path in active:
            for _ in range(10):  # warm-up
                if path.small_error is None:
                    await small(path, False)
        for first in range(0, args.iters, block):
            for path in active:
                for _ in range(min(block, args.iters - first)):
                    if path.small_error is not None:
                        break
                    await small(path, True)

        foreign = meter.foreign_fraction()
        if foreign is not None:
            notes.append(
                f"other processes kept the machine {foreign:.0%} busy during the measurements "
                f"(load average {os.getloadavg()[0]:.2f}); ratios are to raw TCP measured alongside"
            )
        # which way did the libp2p paths really go?
        by_key = {p.key: p for p in paths}
        for key, p2p, bridge in (
            ("libp2p_direct", p2p_direct, bridge_direct),
            *((k, *v) for k, v in relayed_clients.items()),
        ):
            if p2p is None or bridge is None:
                continue
            addrs = await _peer_addrs(p2p, server_id)
            kinds = sorted({way for way, _ in bridge.traffic.bytes})
            by_key[key].route = (
                f"{await bridge.connection_path(server_id)}; server at {', '.join(addrs) or '?'}; "
                f"client bridge bytes by path: {bridge.traffic.as_dict()}"
            )
            if key != "libp2p_direct" and kinds != ["relayed"]:
                by_key[key].notes.append(
                    f"NOT (only) relayed: bridge traffic went over {kinds} (no private network "
                    f"namespace: libp2p switched to a direct connection)"
                )
        by_key["hivemind_p2p"].route = f"libp2p stream; server at {', '.join(await _peer_addrs(p2p_direct, server_id))}"
        kind, stats = _request(server_pipe, "stats", 30)
        if kind == "stats":
            notes.append(
                f"server: bytes by path {stats['traffic']}, bridge streams in {stats['streams_in']}, "
                f"refused {stats['refused'] or 'none'}, rejected {stats['rejected'] or 'none'}"
                + (f" ({'; '.join(stats['rejections'])})" if stats["rejections"] else "")
                + (f"; refusals: {'; '.join(stats['refusals'])}" if stats["refusals"] else "")
            )
            circuit_path = by_key.get("libp2p_circuit")
            if circuit_path is not None and circuit_path.bulk_error:
                circuit_path.notes.append(
                    "p2pd's relay resets a circuit after 128 KiB per direction in most runs "
                    "(transport/relay.py says why); nodes use the swarm relay instead"
                )
            if "private_visible" in stats:
                notes.append(f"private server daemon: visible maddrs {stats['private_visible']}")
    finally:
        for close in reversed(closers):
            try:
                await asyncio.wait_for(close(), 10)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if raw is not None:
            raw.close()
        for proc in procs[1:]:  # the server: ask it to stop, then end its group
            try:
                server_pipe.send("stop")
            except (OSError, ValueError, NameError):
                pass
        for daemon in daemons:
            try:
                await asyncio.wait_for(daemon.shutdown(), 10)
            except Exception:  # noqa: BLE001
                pass
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        if len(procs) > 1:
            try:
                os.killpg(procs[1].pid, signal.SIGKILL)  # the server's p2pd, should any be left
            except (ProcessLookupError, PermissionError):
                pass
        identity.close()
    return report(paths, notes, args, bulk_bytes, in_netns)


def report(paths: list[Transport], notes: list[str], args, bulk_bytes: int, in_netns: bool) -> dict:
    rows = {}
    for path in paths:
        row = {
            "label": path.label,
            "route": path.route,
            "error": path.error,
            "bulk_error": path.bulk_error,
            "small_error": path.small_error,
            "notes": path.notes,
        }
        if path.bulk_s:
            mbs = [bulk_bytes / 1e6 / s for s in path.bulk_s]
            row.update(mb_s=statistics.median(mbs), mb_s_min=min(mbs), mb_s_max=max(mbs), mb_s_runs=mbs)
        if path.lat_s:
            row.update(p50_us=statistics.median(path.lat_s) * 1e6, p99_us=_p99(path.lat_s) * 1e6, calls=len(path.lat_s))
        rows[path.key] = row
    base = rows.get("raw_tcp", {})
    for row in rows.values():
        if "mb_s" in row and base.get("mb_s"):
            row["throughput_ratio"] = row["mb_s"] / base["mb_s"]
        if "p50_us" in row and base.get("p50_us"):
            row["p50_ratio"] = row["p50_us"] / base["p50_us"]
    print()
    print(f"{'transport':<30} {'MB/s median [min-max]':>24} {'x raw':>6} {'p50 us':>8} {'p99 us':>8} {'p50/raw':>8}")
    for key, row in rows.items():
        if row["error"]:
            print(f"{row['label']:<30} {'not measured':>24}")
            continue
        failed = "FAILED" if row["bulk_error"] else "-"
        mbs = f"{row['mb_s']:.0f} [{row['mb_s_min']:.0f}-{row['mb_s_max']:.0f}]" if "mb_s" in row else failed
        ratio = f"{row['throughput_ratio']:.3f}" if "throughput_ratio" in row else "-"
        failed = "FAILED" if row["small_error"] else "-"
        p50 = f"{row['p50_us']:.0f}" if "p50_us" in row else failed
        p99 = f"{row['p99_us']:.0f}" if "p99_us" in row else failed
        lat = f"{row['p50_ratio']:.1f}" if "p50_ratio" in row else "-"
        print(f"{row['label']:<30} {mbs:>24} {ratio:>6} {p50:>8} {p99:>8} {lat:>8}")
    print()
    for key, row in rows.items():
        print(f"{row['label']}: {row['route'] or '-'}")
        for what in ("error", "bulk_error", "small_error"):
            if row[what]:
                print(f"  {what.replace('_', ' ')}: {row[what]}")
        for note in row["notes"]:
            print(f"  note: {note}")
    for note in notes:
        print(f"note: {note}")
    print()
    targets = []
    for key, share, text in TARGETS:
        row = rows.get(key, {})
        got = row.get("throughput_ratio")
        if row.get("error") or any(n.startswith("NOT") for n in row.get("notes", [])):
            verdict = "n/a"
        elif row.get("bulk_error"):
            verdict = "MISS (a bulk call failed)"
        else:
            verdict = "n/a" if got is None else ("PASS" if got >= share else "MISS")
        shown = f"{got:.1%}" if got is not None else "no throughput"
        print(f"target: {text}: {shown} -> {verdict}")
        targets.append({"target": text, "key": key, "min_ratio": share, "ratio": got, "verdict": verdict})
    return {
        "config": {
            "mib": args.mib,
            "repeats": args.repeats,
            "iters": args.iters,
            "small_kib": args.small_kib,
            "chunk_bytes": CHUNK,
            "relays": args.relays,
            "relay_discovery": args.relay_discovery,
            "private_netns": in_netns,
            "cores": os.cpu_count(),
        },
        "results": rows,
        "targets": targets,
        "notes": notes,
    }


def maybe_reexec_in_netns(args) -> int | None:
    """Run this benchmark again inside a private network namespace (see the module docstring);
    returns its exit code, or None to run here."""
    if os.environ.get(NETNS_ENV) == "1":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
        return None
    if args.netns == "off" or args.relays == 0:
        return None
    missing = [tool for tool in ("unshare", "ip", "iptables") if shutil.which(tool) is None]
    why = "needs root" if os.geteuid() != 0 else (f"{', '.join(missing)} not found" if missing else None)
    if why is None:
        probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, timeout=30)
        why = None if probe.returncode == 0 else f"unshare --net failed: {probe.stderr.strip()}"
    if why is not None:
        if args.netns == "on":
            raise SystemExit(f"--netns on: {why}")
        print(f"no private network namespace ({why}): the relayed row will say where its traffic went", flush=True)
        return None
    env = dict(os.environ, **{NETNS_ENV: "1"})
    return subprocess.run(
        ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env=env
    ).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=None, help="bulk payload in MiB (default 64; --quick 16)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed bulk calls per transport (default 7; --quick 3)"
    )
    parser.add_argument("--iters", type=int, default=None, help="small calls per transport (default 400; --quick 100)")
    parser.add_argument("--small-kib", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a ~30 s run: 16 MiB x 3, 100 small calls")
    parser.add_argument("--relays", type=int, default=1, help="relay daemons (0: no relayed row)")
    parser.add_argument("--relay-wait-s", type=float, default=45.0)
    parser.add_argument(
        "--relay-flags",
        default="{}",
        help='extra p2pd flags for the relay daemons, as JSON, e.g. {"relayBufferSize": 1048576}',
    )
    parser.add_argument(
        "--relay-discovery",
        action="store_true",
        help="start the private daemon with p2pd's relay discovery on (nodes turn it off)",
    )
    parser.add_argument("--call-timeout-s", type=float, default=120.0)
    parser.add_argument("--netns", choices=["auto", "on", "off"], default="auto")
    parser.add_argument(
        "--wait-idle-s",
        type=float,
        default=None,
        help="wait up to this long for a quiet machine before measuring (default 20; --quick 5)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    args.mib = args.mib or (16 if args.quick else 64)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.iters = args.iters or (100 if args.quick else 400)
    if args.wait_idle_s is None:
        args.wait_idle_s = 5.0 if args.quick else 20.0
    if args.small_kib < 4 or args.small_kib % 4:
        parser.error("--small-kib must be a multiple of 4")
    code = maybe_reexec_in_netns(args)
    if code is not None:
        sys.exit(code)
    started = time.monotonic()
    out = asyncio.run(run(args))
    out["wall_s"] = time.monotonic() - started
    print(f"wall time {out['wall_s']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
