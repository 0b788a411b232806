"""A node's life: start (identity, directory, stage, parts, services, reachability, state),
heartbeat, train (stage 0), stop (withdraw, drain, checkpoint, outputs) and moving to another
stage. Building the parts is node/assembly.py's; this module only orders the steps."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.config import NodeConfig
from noloco_node.dht.directory import PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.model.build import run_model
from noloco_node.node.attention import Progress
from noloco_node.node.assembly import ComputeParts, PipelineParts, build_compute, build_driver
from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.node.discovery import choose_stage, start_directory
from noloco_node.node.joining import (
    announced_address,
    contact_lookup,
    fetch_state,
    settle_reach,
    wait_for_replicas,
)
from noloco_node.node.leaving import abandon, leave
from noloco_node.node.manifest import load_run_inputs
from noloco_node.node.presence import heartbeat, watch_balance
from noloco_node.node.wiring import NodeHooks, SnapshotOutputs, WiringInputs, wire_services
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.ports import Hop
from noloco_node.pipeline.rebalance import Move
from noloco_node.rpc.security import build_admission, read_swarm_key
from noloco_node.rpc.server import NodeServer
from noloco_node.rpc.stage_service import GRPC_OPTIONS
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.memory import tune_allocator
from noloco_node.runtime.node_stats import NodeStats
from noloco_node.runtime.node_status import Status
from noloco_node.runtime.throughput import ThroughputMeter
from noloco_node.sync.factory import method_traits
from noloco_node.sync.ports import OuterSync
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.links import Links

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeOutputs:
    """What a node writes besides checkpoints: its stats (and weights) on exit, and, for
    experiments, theta every `snapshot_every` inner steps."""

    out_dir: Path | None = None
    save_weights: bool = False
    snapshot_every: int = 0
    snapshot_dir: Path = Path("snapshots")


@dataclass
class Membership:
    """Who this node is in the swarm, across moves between stages."""

    identity: NodeIdentity | None = None
    moves: list[dict] = field(default_factory=list)
    """each: from, to, at, inner_step, and the stage-0 driver's microbatches before it"""


class Node:
    def __init__(
        self, config: NodeConfig, *, outputs: NodeOutputs = NodeOutputs(), membership: Membership | None = None
    ) -> None:
        """A node that moved between stages keeps its identity (peer id) and the record of its
        moves. Only a method whose traits say so moves (NoLoCo): the mover needs a replica's state
        (FetchState), and the all-reduce baselines' groups have a fixed size."""
        self.config, self.outputs = config, outputs
        self.traits = method_traits(config.outer.method)
        membership = membership or Membership()
        self.identity = membership.identity or NodeIdentity.from_file_or_fresh(config.security.identity_file)
        self.moves = list(membership.moves)
        rebalance = config.pipeline.rebalance
        self.movable = (
            (config.pipeline.stage is None if rebalance is None else rebalance)
            and config.pipeline.num_stages > 1
            and self.traits.movable
        )
        self.move: Move | None = None
        self.move_claimed_at = 0.0
        self.move_requested = asyncio.Event()
        self.stage_index = config.pipeline.stage
        self.meter = ThroughputMeter()
        self.events = EventLog(config.log.events_file)
        self.faults = FaultInjector(config.faults.inject)
        self.started_at = time.monotonic()
        self.status = Status.JOINING
        self.progress = Progress()
        self.stage_replicas: int | None = None  # live replicas of our stage, ours included (heartbeat)
        self.done_at_step: int | None = None  # stage 0 trained all its steps and only serves now
        self.directory: PeerDirectory | None = None
        self.server: NodeServer | None = None
        self.links: Links | None = None
        self.driver: Stage0Driver | None = None
        self.metrics = None
        self.metrics_port = None
        self.dashboard = None
        self.fetched_state: dict | None = None
        self.resumed_from: dict | None = None
        self._background: set[asyncio.Task] = set()

    # ---- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Run inputs, stage, compute parts, DHT peer, server, services, reachability, state; then
        announce ourselves and start the background work."""
        tune_allocator()
        swarm_key = read_swarm_key(self.config.security)
        all_reduce = await self._build_parts(swarm_key)
        await self._open_server(swarm_key)
        self._wire(all_reduce)
        await self._serve()
        await self._join_state()
        self.status = Status.SERVING
        await self.announce()
        self.spawn(heartbeat(self))
        if self.movable:
            self.spawn(watch_balance(self))
        if self.snapshots is not None:
            await self.snapshots.save(self.worker.inner_steps)
        self.events.bind(peer=self.peer_id, stage=self.stage_index)
        self.events.emit(
            "started",
            address=self.address,
            manifest_hash=self.manifest_hash,
            method=self.config.outer.method,
            resumed_from=self.resumed_from,
            fetched_state=self.fetched_state,
        )
        log.info(
            "stage %d serving at %s (peer %s, manifest %s)",
            self.stage_index,
            self.address,
            self.peer_id,
            self.manifest_hash,
        )

    async def _build_parts(self, swarm_key: bytes | None) -> object | None:
        """The run's inputs, our stage (chosen in the DHT with --stage auto), its compute parts and,
        for an all-reduce method, hivemind's averager (returned)."""
        cfg = self.config
        self.corpus, self.tokenizer, self.manifest_hash = load_run_inputs(cfg)
        if self.stage_index is None:
            self.directory, self.stage_index = await choose_stage(cfg, self.manifest_hash, self.identity, swarm_key)
        llama, ranges = run_model(cfg, len(self.tokenizer))
        self.parts: ComputeParts = build_compute(
            cfg, llama, ranges, self.stage_index, vocab_size=len(self.tokenizer), events=self.events, faults=self.faults
        )
        if not self.traits.all_reduce:
            return None
        # hivemind forks its DHT and averager processes: do it before gRPC starts any thread.
        from noloco_node.dht.averaging import build_all_reduce

        return build_all_reduce(cfg, self.stage_index, self.traits.all_reduce_shapes(self.parts.worker), swarm_key)

    async def _open_server(self, swarm_key: bytes | None) -> None:
        """Our DHT peer, the links peers reach us by, and the gRPC server, bound (not started)."""
        cfg = self.config
        if self.directory is None:
            self.directory = await start_directory(cfg, self.manifest_hash, self.identity, swarm_key)
        self.peer_id = self.directory.peer_id
        self.links = Links(
            self.identity,
            swarm_key=swarm_key,
            max_skew_s=cfg.security.max_clock_skew_s,
            lookup=contact_lookup(self.directory),
            options=GRPC_OPTIONS,
        )
        self.admission = build_admission(cfg.security, self.links)
        self.server = NodeServer(
            cfg.network.host,
            cfg.network.port,
            admission=self.admission.interceptor,
            credentials=self.links.certificate.server_credentials(),
            max_concurrent_rpcs=cfg.security.max_concurrent_rpcs,
        )
        port = self.server.bind()
        self.address = announced_address(
            cfg.network.host, port, cfg.network.announce_addr, await self.directory.visible_maddrs()
        )

    def _wire(self, all_reduce: object | None) -> None:
        """The services (node/wiring.py), kept as the node's own attributes: stats, metrics and the
        pages read them there."""
        services = wire_services(
            WiringInputs(
                config=self.config,
                parts=self.parts,
                manifest_hash=self.manifest_hash,
                me=Hop(self.peer_id, self.address, self.stage_index),
                links=self.links,
                directory=self.directory,
                server=self.server,
                link_estimates=self.meter.links,
            ),
            NodeHooks(
                events=self.events,
                faults=self.faults,
                observe_rpc=self._observe_rpc,
                set_status=self._set_status,
                bytes_sent=self.bytes_sent,
            ),
            SnapshotOutputs(self.outputs.snapshot_every, self.outputs.snapshot_dir),
            all_reduce,
        )
        self.client, self.outer_client = services.client, services.outer_client
        self.outer_traffic = services.outer_traffic
        self.checkpoints, self.snapshots = services.checkpoints, services.snapshots
        self.sync: OuterSync = services.sync
        self.boundary: InnerStepBoundary = services.boundary
        self.pipeline: PipelineParts = services.pipeline
        self.servicer = services.servicer

    async def _serve(self) -> None:
        """Start the services, find out how peers reach us, and open /metrics."""
        cfg = self.config
        await self.server.start()
        await self.links.attach(self.directory.p2p, self.server.bridge_port, self.server.tls_target)
        # Relayed until a peer proves it dials us; the heartbeat then asks again (node/joining.py).
        self.reprobe = await settle_reach(
            self.directory, self.links, cfg, address=self.address, server=self.server, announce=self.announce
        )
        if cfg.network.metrics_port is not None:
            from noloco_node.node.metrics import NodeMetrics

            self.metrics = NodeMetrics(self.read_stats, peer_id=self.peer_id, stage=self.stage_index)
            self.metrics_port = self.metrics.serve(cfg.network.host, cfg.network.metrics_port)
        if cfg.network.dashboard is not None:
            from noloco_node.node.dashboard import NodeDashboard

            self.dashboard = await NodeDashboard.open(self)

    async def _join_state(self) -> None:
        """Resume from our own checkpoint, else (a method whose replicas donate state: NoLoCo) copy
        a live replica's state."""
        if self.checkpoints is not None:
            self.resumed_from = await self.checkpoints.resume(self.stage_index)
            if self.resumed_from is not None:
                log.info("resumed from checkpoint at inner step %d", self.resumed_from["inner_step"])
                self.sync.start_at(self.resumed_from["outer_round"])
        if self.resumed_from is None and self.traits.donates_state:
            self.fetched_state = await fetch_state(
                self.directory,
                self.outer_client,
                self.parts.compute,
                self.parts.outer_state,
                self.worker.inner,
                stage=self.stage_index,
                peer_id=self.peer_id,
                timeout_s=self.config.timeouts.rpc_s,
            )
            if self.fetched_state is not None:
                self.sync.start_at(self.fetched_state["outer_round"])

    # ---- parts other modules read -----------------------------------------------------------
    @property
    def worker(self):
        return self.parts.worker

    @property
    def runtime(self):
        return self.pipeline.runtime

    @property
    def outer_round(self) -> int:
        return self.sync.outer_round

    def bytes_sent(self) -> int:
        """Payload bytes this node sent: pipeline and outer sync."""
        return self.client.bytes_sent + self.sync.bytes_sent

    def stats(self) -> dict:
        """The stats file's dict: `read_stats().to_dict()`."""
        return self.read_stats().to_dict()

    def read_stats(self) -> NodeStats:
        """Everything the node reports about itself, typed, each part reporting its own numbers."""
        from noloco_node.node.stats import node_stats

        return node_stats(self)

    @property
    def tokens_per_s(self) -> float:
        """Tokens this stage processed per second since it started."""
        return float(self.worker.tokens_total / max(1e-6, time.monotonic() - self.started_at))

    # ---- the swarm's view of us ------------------------------------------------------------
    async def _set_status(self, status: str, round_index: int) -> None:
        self.status = status
        await self.announce()

    def record(self) -> StageRecord:
        from noloco_node.node.stats import stage_record

        return stage_record(self)

    def attention(self) -> list[str]:
        """What needs a person's attention now (node/attention.py), each with its likely cause."""
        from noloco_node.node.stats import node_attention

        return node_attention(self)

    async def announce(self, ttl_s: float | None = None) -> None:
        await self.directory.announce(self.record(), ttl_s=ttl_s or self.config.timeouts.record_ttl_s)

    async def claim_move(self, claimed_at: float) -> None:
        """Announce (t > 0) or withdraw (0) our claim to a rebalancing move (pipeline/rebalance.py)."""
        self.move_claimed_at = claimed_at
        await self.announce()

    def _observe_rpc(self, method: str, seconds: float) -> None:
        if method == "Forward":
            self.meter.observe_hop(seconds)
        if self.metrics is not None:
            self.metrics.observe_rpc(method, seconds)

    def spawn(self, coro) -> asyncio.Task:
        """A background task of this node's: cancelled when it stops."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- training (stage 0) -----------------------------------------------------------------
    async def wait_for_replicas(self, count: int, *, later_stages_only: bool = False) -> None:
        """Block until every stage (or every stage after ours) shows at least `count` live replicas;
        `progress` says which is short."""
        first = self.stage_index + 1 if later_stages_only else 0
        await wait_for_replicas(
            self.directory, range(first, self.config.pipeline.num_stages), count, self.progress.wait
        )

    async def train(self, steps: int, on_inner_step=None) -> None:
        """Stage 0 only: run `steps` inner steps over this replica's data shard; `on_inner_step(step)`
        is awaited after each, after the node's own boundary (events, outer sync, checkpoints)."""
        from noloco_node.data.loader import ShardSpec, training_batches

        cfg = self.config
        replicas = await self.directory.replicas(0, fresh=True)
        ids = sorted(r.peer_id for r in replicas)
        shard = ShardSpec(
            shard_index=ids.index(self.peer_id) if self.peer_id in ids else 0, num_shards=max(1, len(ids))
        )
        batches = training_batches(cfg, self.corpus, self.tokenizer, shard)
        self.driver = build_driver(
            cfg,
            self.pipeline,
            self.sync,
            batches,
            restored=(self.resumed_from or {}).get("microbatches"),
            # Not our own stage: under load our record can lapse for a moment.
            before_batch=lambda: self.wait_for_replicas(1, later_stages_only=True),
        )

        async def after_step(step: int) -> None:
            await self.boundary(step, self.driver)
            if on_inner_step is not None:
                await on_inner_step(step)

        await self.driver.run(steps, after_step)

    # ---- stop ------------------------------------------------------------------------------
    async def stop(self, grace_s: float | None = None, *, final: bool = True) -> None:
        """Finish a running outer step, withdraw the DHT record (status leaving), drain the
        microbatches in flight within `grace_s`, checkpoint, write stats (and weights), shut down.
        `final=False` (a move to another stage): no checkpoint, snapshot or outputs of this stage."""
        await leave(self, grace_s, final=final)

    async def abandon(self) -> None:
        """After a start that failed: close what it had opened (its gRPC server, libp2p links and
        DHT peer; no record to withdraw, nothing to drain), so the process exits quietly with the
        error that stopped it."""
        await abandon(self)

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()
