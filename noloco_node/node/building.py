"""Building a node before it exists: the run's inputs, its stage (chosen in the DHT with --stage
auto), the compute parts, hivemind's averager for an all-reduce method, our DHT peer, the links peers
reach us by, the gRPC server (bound, not started) and the services wired around them (node/wiring.py).

Node.create builds with `build_node` and constructs the Node from what it returns, so a node that
exists is wired. The parts report to objects made before them (NodeBasics: the event log, the
throughput meter, the status board, the RPC timings), never to a half-built node. A build that fails
closes what it had opened and raises."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from noloco_node.config import NodeConfig
from noloco_node.dht.directory import PeerDirectory
from noloco_node.model.build import run_model
from noloco_node.node.assembly import ComputeParts, build_compute
from noloco_node.node.discovery import choose_stage, start_directory
from noloco_node.node.joining import announced_address, contact_lookup
from noloco_node.node.manifest import load_run_inputs
from noloco_node.node.wiring import NodeHooks, NodeServices, SnapshotOutputs, WiringInputs, wire_services
from noloco_node.pipeline.ports import Hop
from noloco_node.rpc.security import Admission, build_admission, read_swarm_key
from noloco_node.rpc.server import NodeServer
from noloco_node.rpc.stage_service import GRPC_OPTIONS
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.node_status import Status
from noloco_node.runtime.throughput import ThroughputMeter
from noloco_node.sync.ports import MethodTraits
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.links import Links

log = logging.getLogger(__name__)


class StatusBoard:
    """The status a node announces in its record (runtime/node_status.Status). The outer sync sets
    it while a round looks for a partner and waits until it is announced; the node says how to
    announce when it is constructed (`publish_with`), before anything runs."""

    def __init__(self) -> None:
        self.status = Status.JOINING
        self._publish: Callable[[], Awaitable[None]] | None = None

    def publish_with(self, publish: Callable[[], Awaitable[None]]) -> None:
        self._publish = publish

    def become(self, status: Status) -> None:
        """The node's own changes (serving, leaving), which it announces itself."""
        self.status = status

    async def set(self, status: str, round_index: int) -> None:
        """sync.ports.SyncParts.set_status: the new status, announced (the round is in the record)."""
        self.become(Status(status))
        if self._publish is not None:
            await self._publish()


class RpcTimings:
    """Where the stage client reports each call's latency: Forward times feed the throughput meter's
    hop estimate, and every call goes to the sinks added later (/metrics' histogram)."""

    def __init__(self, meter: ThroughputMeter) -> None:
        self.meter = meter
        self.sinks: list[Callable[[str, float], None]] = []

    def observe(self, method: str, seconds: float) -> None:
        if method == "Forward":
            self.meter.observe_hop(seconds)
        for sink in self.sinks:
            sink(method, seconds)


@dataclass(frozen=True)
class NodeBasics:
    """What a node has before any part is built; its identity it keeps across moves between stages."""

    identity: NodeIdentity
    events: EventLog
    faults: FaultInjector
    meter: ThroughputMeter
    board: StatusBoard
    rpc: RpcTimings

    @classmethod
    def for_config(cls, config: NodeConfig, identity: NodeIdentity | None = None) -> NodeBasics:
        meter = ThroughputMeter()
        return cls(
            identity=identity or NodeIdentity.from_file_or_fresh(config.security.identity_file),
            events=EventLog(config.log.events_file),
            faults=FaultInjector(config.faults.inject),
            meter=meter,
            board=StatusBoard(),
            rpc=RpcTimings(meter),
        )


@dataclass(frozen=True)
class BuiltNode:
    """Everything Node.create built, in the order it was built."""

    corpus: object
    tokenizer: object
    manifest_hash: str
    stage_index: int
    parts: ComputeParts
    directory: PeerDirectory
    links: Links
    admission: Admission
    server: NodeServer
    address: str
    services: NodeServices


class _Opened:
    """What a build has opened so far, closed in reverse if a later step fails."""

    def __init__(self) -> None:
        self.closers: list[tuple[str, Callable[[], Awaitable[None] | None]]] = []

    def add(self, name: str, close: Callable[[], Awaitable[None] | None]) -> None:
        self.closers.append((name, close))

    async def close(self) -> None:
        for name, close in reversed(self.closers):
            try:
                result = close()
                if result is not None:
                    await asyncio.wait_for(result, timeout=10)
            except Exception as exc:  # noqa: BLE001 - failing with the build's error anyway
                log.debug("closing the %s after a failed build: %r", name, exc)


async def build_node(
    config: NodeConfig, basics: NodeBasics, traits: MethodTraits, snapshots: SnapshotOutputs
) -> BuiltNode:
    """Every part of a node, wired; nothing started but the DHT peer (and the averager's processes)."""
    opened = _Opened()
    try:
        return await _build(config, basics, traits, snapshots, opened)
    except BaseException:
        await opened.close()
        raise


async def _build(
    cfg: NodeConfig, basics: NodeBasics, traits: MethodTraits, snapshots: SnapshotOutputs, opened: _Opened
) -> BuiltNode:
    swarm_key = read_swarm_key(cfg.security)
    corpus, tokenizer, manifest_hash = load_run_inputs(cfg)
    directory, stage = None, cfg.pipeline.stage
    if stage is None:
        directory, stage = await choose_stage(cfg, manifest_hash, basics.identity, swarm_key)
        opened.add("dht", directory.shutdown)
    llama, ranges = run_model(cfg, len(tokenizer))
    parts = build_compute(
        cfg, llama, ranges, stage, vocab_size=len(tokenizer), events=basics.events, faults=basics.faults
    )
    opened.add("compute thread", parts.compute.shutdown)
    all_reduce = None
    if traits.all_reduce:
        # hivemind forks its DHT and averager processes: do it before gRPC starts any thread.
        from noloco_node.dht.averaging import build_all_reduce

        all_reduce = build_all_reduce(cfg, stage, traits.all_reduce_shapes(parts.worker), swarm_key)
        opened.add("averager", all_reduce.shutdown)
    if directory is None:
        directory = await start_directory(cfg, manifest_hash, basics.identity, swarm_key)
        opened.add("dht", directory.shutdown)
    links, admission, server, address = await _open_server(cfg, basics.identity, directory, swarm_key, opened)
    services = wire_services(
        WiringInputs(
            config=cfg,
            parts=parts,
            manifest_hash=manifest_hash,
            me=Hop(directory.peer_id, address, stage),
            links=links,
            directory=directory,
            server=server,
            link_estimates=basics.meter.links,
        ),
        NodeHooks(
            events=basics.events, faults=basics.faults, observe_rpc=basics.rpc.observe, set_status=basics.board.set
        ),
        snapshots,
        all_reduce,
    )
    return BuiltNode(
        corpus, tokenizer, manifest_hash, stage, parts, directory, links, admission, server, address, services
    )


async def _open_server(
    cfg: NodeConfig, identity: NodeIdentity, directory: PeerDirectory, swarm_key: bytes | None, opened: _Opened
) -> tuple[Links, Admission, NodeServer, str]:
    """The links peers reach us by, who is admitted, and the gRPC server (bound, not started) at
    the address we announce."""
    links = Links(
        identity,
        swarm_key=swarm_key,
        max_skew_s=cfg.security.max_clock_skew_s,
        lookup=contact_lookup(directory),
        options=GRPC_OPTIONS,
    )
    opened.add("links", links.close)
    admission = build_admission(cfg.security, links)
    server = NodeServer(
        cfg.network.host,
        cfg.network.port,
        admission=admission.interceptor,
        credentials=links.certificate.server_credentials(),
        max_concurrent_rpcs=cfg.security.max_concurrent_rpcs,
    )
    port = server.bind()
    opened.add("server", lambda: server.stop(0))
    address = announced_address(cfg.network.host, port, cfg.network.announce_addr, await directory.visible_maddrs())
    return links, admission, server, address
