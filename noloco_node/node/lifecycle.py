"""A node's life: start (identity, directory, stage, parts, services, reachability, state),
heartbeat, train (stage 0), stop (withdraw, drain, checkpoint, outputs) and moving to another
stage. Building the parts is node/assembly.py's; this module only orders the steps."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node import __version__
from noloco_node.config import NodeConfig
from noloco_node.dht.directory import PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.model.build import run_model
from noloco_node.node.adapters import DhtMatching, DhtReplicas, swarm_replicas
from noloco_node.node.attention import Progress
from noloco_node.node.assembly import AssemblyPorts, ComputeParts, PipelineParts, assemble, build_compute, build_driver
from noloco_node.node.boundary import InnerStepBoundary, Snapshots
from noloco_node.node.checkpoint import Checkpointer
from noloco_node.node.discovery import choose_stage, start_directory
from noloco_node.node.joining import (
    announced_address,
    contact_lookup,
    fetch_state,
    look_around,
    public_libp2p_addrs,
    settle_reach,
    wait_for_replicas,
)
from noloco_node.node.manifest import load_run_inputs
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.ports import Hop
from noloco_node.pipeline.rebalance import Move, watch
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterClient, OuterServicer, Traffic
from noloco_node.rpc.security import build_admission, read_swarm_key
from noloco_node.rpc.server import NodeServer
from noloco_node.rpc.stage_service import GRPC_OPTIONS, StageClient, StageCodecs, StageServicer
from noloco_node.rpc.stage_transport import GrpcStageTransport
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.every import LOOK_BUSY_S, LOOK_IDLE_S, TOUCH_PERIOD_S, Every
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import DeadlinePolicy, LinkDeadlines
from noloco_node.runtime.memory import tune_allocator
from noloco_node.runtime.node_status import Status
from noloco_node.runtime.throughput import ThroughputMeter
from noloco_node.sync.factory import SyncPorts, method_traits
from noloco_node.sync.ports import OuterSync
from noloco_node.sync.transfer import counters_json, export_state
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
        self._touching: asyncio.Task | None = None
        self._touch, self._look = Every(), Every()

    # ---- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        tune_allocator()
        identity = self.identity
        swarm_key = read_swarm_key(cfg.security)
        self.corpus, self.tokenizer, self.manifest_hash = load_run_inputs(cfg)
        if self.stage_index is None:
            self.directory, self.stage_index = await choose_stage(cfg, self.manifest_hash, identity, swarm_key)
        llama, ranges = run_model(cfg, len(self.tokenizer))
        self.parts: ComputeParts = build_compute(
            cfg, llama, ranges, self.stage_index, vocab_size=len(self.tokenizer), events=self.events, faults=self.faults
        )
        all_reduce = None
        if self.traits.all_reduce:
            # hivemind forks its DHT and averager processes: do it before gRPC starts any thread.
            from noloco_node.dht.averaging import build_all_reduce

            shapes = self.traits.all_reduce_shapes(self.parts.worker)
            all_reduce = build_all_reduce(cfg, self.stage_index, shapes, swarm_key)
        if self.directory is None:
            self.directory = await start_directory(cfg, self.manifest_hash, identity, swarm_key)
        self.peer_id = self.directory.peer_id
        self.links = Links(
            identity,
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
        self._wire(all_reduce)
        await self._serve()
        await self._join_state()
        self.status = Status.SERVING
        await self.announce()
        self._spawn(self._heartbeat())
        if self.movable:
            self._spawn(self._watch_balance())
        if self.snapshots is not None:
            await self.snapshots.save(self.worker.inner_steps)
        self.events.bind(peer=self.peer_id, stage=self.stage_index)
        self.events.emit(
            "started",
            address=self.address,
            manifest_hash=self.manifest_hash,
            method=cfg.outer.method,
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

    def _wire(self, all_reduce) -> None:
        """Clients, the outer-sync method, the boundary, the pipeline and the services, in the order
        each needs the one before."""
        cfg, parts = self.config, self.parts
        # Every call's deadline follows its peer's link, as measured by the meter's estimates (announced).
        deadlines = LinkDeadlines(self.meter.links, DeadlinePolicy.from_timeouts(cfg.timeouts))
        self.client = StageClient(
            run_id=cfg.run.run_id,
            manifest_hash=self.manifest_hash,
            codecs=StageCodecs(cfg.pipeline.activation_codec, cfg.pipeline.gradient_codec),
            timeout_s=cfg.timeouts.rpc_s,
            deadlines=deadlines,
            observe=self._observe_rpc,
            dialer=self.links.dialer,
        )
        state_bytes = sum(p.numel() * 16 for p in parts.stage.parameters())
        self.outer_traffic = Traffic()
        outer_client = OuterClient(
            run_id=cfg.run.run_id,
            manifest_hash=self.manifest_hash,
            max_bytes=state_bytes,
            traffic=self.outer_traffic,
            faults=self.faults,
            dialer=self.links.dialer,
            deadlines=deadlines.floored(cfg.timeouts.match_s),
        )
        self.outer_client = outer_client
        stage_directory = DhtMatching(self.directory)
        ports = AssemblyPorts(
            sync=SyncPorts(
                pairing=outer_client, matching=stage_directory, all_reduce=all_reduce, progress=stage_directory
            ),
            transport=GrpcStageTransport(self.client),
            directory=DhtReplicas(self.directory),
            me=Hop(self.peer_id, self.address, self.stage_index),
            set_status=self._set_status,
            bytes_sent=self.bytes_sent,
        )
        name = f"stage{self.stage_index}-{self.peer_id[-8:]}"
        self.checkpoints = (
            None
            if cfg.checkpoint.dir is None
            else Checkpointer(
                Path(cfg.checkpoint.dir).expanduser(),
                cfg.checkpoint.every_steps,
                compute=parts.compute,
                stage=parts.stage,
                identity={"run_id": cfg.run.run_id, "manifest_hash": self.manifest_hash, "peer_id": self.peer_id},
                inner=parts.worker.inner,
                outer=parts.outer_state,
            )
        )
        self.snapshots = (
            None
            if not self.outputs.snapshot_every
            else Snapshots(
                self.outputs.snapshot_dir,
                self.outputs.snapshot_every,
                compute=parts.compute,
                stage=parts.stage,
                name=name,
            )
        )
        assembly = assemble(
            cfg,
            parts,
            ports,
            events=self.events,
            faults=self.faults,
            checkpoints=self.checkpoints,
            snapshots=self.snapshots,
        )
        self.sync: OuterSync = assembly.sync
        self.boundary: InnerStepBoundary = assembly.boundary
        self.pipeline: PipelineParts = assembly.pipeline
        max_bytes = cfg.pipeline.microbatch_size * cfg.model.seq_len * parts.shape.boundary_width * 4
        self.servicer = StageServicer(
            self.runtime,
            run=ServedRun(cfg.run.run_id, self.manifest_hash),
            max_payload_bytes=max_bytes,
            receive_s=cfg.timeouts.receive_s,
            min_bytes_per_s=cfg.security.min_receive_bytes_per_s,
            rms_factor=cfg.security.payload_rms_factor,
            max_abs=cfg.security.payload_max_abs,
            deadlines=deadlines,
        )
        self.server.add_stage(self.servicer)
        if self.sync.responder is not None:  # pairing, and state for joiners (traits.donates_state)
            self.server.add_outer(
                OuterServicer(
                    self.sync.responder,
                    peer_id=self.peer_id,
                    run=ServedRun(cfg.run.run_id, self.manifest_hash, self.stage_index),
                    max_bytes=state_bytes,
                    deadlines=deadlines.floored(cfg.timeouts.match_s),
                    traffic=self.outer_traffic,
                    faults=self.faults,
                    donor=self,
                )
            )
        from noloco_node.rpc.diagnostics import DiagnosticsServicer

        self.server.add_diagnostics(
            DiagnosticsServicer(
                run_id=cfg.run.run_id,
                version=__version__,
                manifest_hash=self.manifest_hash,
                timeout_s=cfg.timeouts.connect_s,
            )
        )

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

            self.metrics = NodeMetrics(self.stats, peer_id=self.peer_id, stage=self.stage_index)
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

    async def export_state(self) -> tuple[dict, str]:
        """sync.ports.StateDonor: a consistent copy of our state, taken on the compute thread."""
        tensors, counters = await self.parts.compute.run(
            export_state, self.parts.outer_state, self.worker.inner, inner_step=self.worker.inner_steps
        )
        return tensors, counters_json(counters)

    def stats(self) -> dict:
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

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.heartbeat_s)
            try:
                self.meter.sample(
                    sequences=self.worker.sequences_total,
                    busy_s=self.parts.compute.busy_s,
                    in_flight=len(self.runtime.in_flight),
                    window=self.config.pipeline.max_in_flight,
                )
                if (self._touching is None or self._touching.done()) and self._touch.due(TOUCH_PERIOD_S):
                    # Its own task: a dead peer takes seconds.
                    self._touching = asyncio.create_task(self.directory.keep_in_touch())
                    self._spawn_task(self._touching)
                await self._look_around()
                await self.announce()
                await self.runtime.expire_saved()
                if self.reprobe is not None and self.reprobe.due():  # its own task: a probe takes seconds
                    self._spawn(self.reprobe.run())
                if self.links.reach != "direct" and self.links.bridge is not None:  # behind NAT: see joining.py
                    await self.links.bridge.dial_out(
                        await public_libp2p_addrs(self.directory, self.config.pipeline.num_stages)
                    )
            except Exception:  # noqa: BLE001 - a failed heartbeat is retried next period
                log.exception("heartbeat failed")

    async def _look_around(self) -> None:
        """How many replicas our stage has (a lone one pairs with nobody), and, unless we already wait
        for something else, which neighbouring stage has none (we wait for it, and say so). Every
        LOOK_IDLE_S while we make no progress, every LOOK_BUSY_S while we do: a training node has its
        neighbours, and DHT lookups on every 1 s heartbeat cost a busy machine ~15% of its
        throughput (and an idle swarm of three processes 60% more CPU)."""
        busy = self.progress.since_progress_s() < 2 * self.config.timeouts.heartbeat_s
        # A view of our stage as lone is looked at again soon: it may be from before a fellow
        # replica announced itself, and it turns every solo round into a "no second replica" warning.
        lone = (self.stage_replicas or 0) < 2
        if not self._look.due(LOOK_BUSY_S if busy and not lone else LOOK_IDLE_S):
            return
        self.stage_replicas, missing = await look_around(
            self.directory, self.stage_index, self.config.pipeline.num_stages
        )
        if self.progress.waiting_for is None or self.progress.waiting_for.startswith("a stage-"):
            self.progress.wait(missing)

    async def _watch_balance(self) -> None:
        """Rebalancing (pipeline/rebalance.py): when the plan names this node, ask whoever serves it
        to move it (node/serving.py: it drains, leaves and comes back on the target stage)."""
        p = self.config.pipeline
        self.move = await watch(
            me=self.peer_id,
            read=lambda: swarm_replicas(self.directory),
            claim=self._claim_move,
            num_stages=p.num_stages,
            margin=p.rebalance_margin,
            period_s=p.rebalance_period_s,
            settle_s=2 * p.rebalance_period_s,
            cooldown_s=10 * p.rebalance_period_s,
        )
        self.events.emit(
            "move_planned",
            source=self.move.source,
            target=self.move.target,
            throughput_now=self.move.throughput_now,
            throughput_after=self.move.throughput_after,
        )
        self.move_requested.set()

    async def _claim_move(self, claimed_at: float) -> None:
        self.move_claimed_at = claimed_at
        await self.announce()

    def _observe_rpc(self, method: str, seconds: float) -> None:
        if method == "Forward":
            self.meter.observe_hop(seconds)
        if self.metrics is not None:
            self.metrics.observe_rpc(method, seconds)

    def _spawn(self, coro) -> None:
        self._spawn_task(asyncio.create_task(coro))

    def _spawn_task(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        cfg = self.config
        grace_s = cfg.timeouts.drain_s if grace_s is None else grace_s
        self.events.emit("stopping", inner_step=self.worker.inner_steps, in_flight=len(self.runtime.in_flight))
        # Let a running outer step finish first, while our record still says we are here: withdrawn
        # first, a partner's lookup no longer found us and an overlapped round in flight at the end
        # went solo (seen in 8 of 20 overlapped loss_price cells); and the weights we save are post-update.
        if not await self.sync.settle(cfg.timeouts.outer_round_s):
            log.warning("an outer step was still running at shutdown")
        self.status = Status.LEAVING
        # A mover's leaving record outlives its trip to the new stage (a restart, a state fetch), so
        # no other node plans a move while this one is in transit (pipeline/rebalance.py).
        ttl_s = None if final else max(cfg.timeouts.record_ttl_s, 2 * cfg.pipeline.rebalance_period_s)
        try:  # withdraw first, so peers stop routing to us while we drain
            await asyncio.wait_for(self.announce(ttl_s), timeout=cfg.timeouts.connect_s)
        except Exception as exc:  # noqa: BLE001 - leaving anyway; the record expires by TTL
            log.info("could not withdraw our record (%r); it expires by its TTL", exc)
        await self.runtime.drain(grace_s)
        if final:
            await self._final_outputs()
        for task in list(self._background):
            task.cancel()
        await self._shut_down()

    async def _final_outputs(self) -> None:
        if self.snapshots is not None:  # where training left this node, whatever inner step that is
            await self.snapshots.save(self.worker.inner_steps, final=True)
        if self.checkpoints is not None:
            await self.boundary.checkpoint(self.driver)
        if self.outputs.out_dir is not None:
            from noloco_node.node.outputs import write_outputs

            write_outputs(self, self.outputs.out_dir)

    async def abandon(self) -> None:
        """After a start that failed: close what it had opened (its gRPC server, libp2p links and
        DHT peer; no record to withdraw, nothing to drain), so the process exits quietly with the
        error that stopped it."""
        closers = {
            "dashboard": self.dashboard and self.dashboard.close,
            "server": self.server and (lambda: self.server.stop(0)),
            "links": self.links and self.links.close,
            "dht": self.directory and self.directory.shutdown,
        }
        for name, close in closers.items():
            if not close:
                continue
            try:
                await asyncio.wait_for(close(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - exiting with the start's error anyway
                log.debug("closing the %s after a failed start: %r", name, exc)

    async def _shut_down(self) -> None:
        timeout_s = self.config.timeouts.connect_s + 5
        await self.sync.close()
        dashboard = self.dashboard.close() if self.dashboard is not None else asyncio.sleep(0)
        for name, step in (
            ("dashboard", dashboard),
            ("server", self.server.stop(1.0)),
            ("client", self.client.close()),
            ("outer client", self.outer_client.close()),
            ("links", self.links.close()),
            ("dht", self.directory.shutdown()),
        ):
            try:
                await asyncio.wait_for(step, timeout=timeout_s)
            except asyncio.TimeoutError:
                log.warning("shutdown of the %s timed out; exiting anyway", name)
        if self.metrics is not None:
            self.metrics.stop()
        self.parts.compute.shutdown()
        self.events.emit("stopped", inner_step=self.worker.inner_steps, saved_inputs=len(self.worker.saved))
        self.events.close()
