"""The composition root: builds a node's parts from its config and wires them together.

    config -> tokenizer, model stage, inner optimizer -> StageWorker (compute thread)
           -> NodeServer (gRPC Stage + health) and StageClient
           -> PeerDirectory (hivemind DHT in this event loop) -> StageRuntime -> Stage0Driver
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path


from noloco_node import __version__
from noloco_node.config import NodeConfig
from noloco_node.node.manifest import load_run_inputs
from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.model.build import build_run_stage, check_fits, run_model
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.ports import Hop
from noloco_node.pipeline.router import Bans, Router
from noloco_node.pipeline.runtime import StageRuntime, StageShape
from noloco_node.pipeline.worker import StageWorker
from noloco_node.rpc.outer_service import OuterClient, OuterServicer, Traffic
from noloco_node.rpc.server import NodeServer
from noloco_node.rpc.stage_service import GRPC_OPTIONS, StageClient, StageServicer
from noloco_node.transport.identity import NodeIdentity
from noloco_node.rpc.security import build_admission, read_swarm_key
from noloco_node.node.adapters import DhtMatching, DhtReplicas, GrpcStageTransport, swarm_replicas
from noloco_node.runtime.compute import ComputeThread, compute_device
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.pipeline.rebalance import Move, watch
from noloco_node.pipeline.stage_choice import claim_stage_in
from noloco_node.runtime.throughput import ThroughputMeter
from noloco_node.runtime.memory import tune_allocator
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.node.joining import (announced_address, contact_lookup, fetch_state, public_libp2p_addrs, settle_reach,
                                 wait_for_replicas)
from noloco_node.transport.links import Links
from noloco_node.sync.transfer import counters_json, export_state

log = logging.getLogger(__name__)


class Node:
    def __init__(self, config: NodeConfig, *, out_dir: Path | None = None, save_weights: bool = False,
                 identity: NodeIdentity | None = None, moves: list[dict] | None = None) -> None:
        """`identity` and `moves`: a node that moved between stages keeps its identity (peer id)
        and the record of its moves (cli/join.py). Only NoLoCo nodes move: the mover needs a
        replica's state (FetchState), and the all-reduce baselines' groups have a fixed size."""
        self.config, self.out_dir, self.save_weights = config, out_dir, save_weights
        self.identity, self.moves = identity, list(moves or [])
        rebalance = config.pipeline.rebalance
        self.movable = (config.pipeline.stage is None if rebalance is None else rebalance) and \
            config.pipeline.num_stages > 1 and config.outer.method == "noloco"
        self.move: Move | None = None
        self.move_requested = asyncio.Event()
        self.sequential = config.pipeline.deterministic
        self.microbatch_timeout_s = config.timeouts.microbatch_s
        self.stage_index = config.pipeline.stage
        self.compute, self.meter = ComputeThread(), ThroughputMeter()
        self.events = EventLog(config.log.events_file)
        self.started_at = time.monotonic()
        self.status = "joining"
        self.outer_round = 0
        self.sync: NoLoCoSync | None = None
        self._outer_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self.driver: Stage0Driver | None = None
        self.metrics = None
        self.fetched_state: dict | None = None
        self.resumed_from: dict | None = None
        self.snapshot_every, self.snapshot_dir = 0, None  # experiments: keep theta every K inner steps

    async def start(self) -> None:
        cfg = self.config
        tune_allocator()
        self.links = Links(self.identity or NodeIdentity.from_file_or_fresh(cfg.security.identity_file),
                           swarm_key=read_swarm_key(cfg.security),
                           max_skew_s=cfg.security.max_clock_skew_s, options=GRPC_OPTIONS)
        self.admission = build_admission(cfg.security, self.links)
        self.faults = FaultInjector(cfg.faults.inject)
        self.corpus, self.tokenizer, self.manifest_hash = load_run_inputs(cfg)
        self.directory: PeerDirectory | None = None
        if self.stage_index is None:
            self.stage_index = await self._choose_stage()
        m = cfg.model
        llama, ranges = run_model(cfg, len(self.tokenizer))
        self.device = compute_device(cfg.pipeline.device)
        check_fits(cfg, llama, ranges, self.stage_index, self.device)  # before anything is allocated
        self.stage = build_run_stage(cfg, llama, ranges, self.stage_index)
        self.stage.to(self.device)  # built (and seeded) on CPU, so every device starts from the same phi_0
        inner = cfg.inner
        schedule = InnerSchedule(lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps,
                                 min_lr_ratio=inner.min_lr_ratio)
        optimizer = InnerOptimizer(self.stage.parameters(), schedule, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                                   weight_decay=inner.weight_decay, clip_norm=inner.clip_norm)
        dp = cfg.outer.method == "dp"
        self.worker = StageWorker(self.stage, optimizer, batch_size=cfg.pipeline.batch_size,
                                  saved_ttl_s=cfg.timeouts.saved_input_ttl_s, auto_step=self.stage_index != 0 and not dp,
                                  device=self.device, bf16_autocast=cfg.pipeline.bf16_autocast, faults=self.faults,
                                  emit=self.events.emit, slow_weights=None if dp or cfg.outer.method == "none" else
                                  lambda: self.outer_state.phi, compute_delay_s=cfg.faults.compute_delay_s)
        # Overlap: a step can fall between a microbatch's forward and its backward here (worker.py).
        self.worker.stash_weights = cfg.pipeline.schedule == "overlap" and not self.stage.is_last
        self.all_reduce = None
        self.dp_step = None
        if cfg.outer.method in ("diloco", "dp"):
            # hivemind forks its DHT and averager processes: do it before gRPC starts any thread.
            from noloco_node.dht.averaging import build_all_reduce

            self.all_reduce = build_all_reduce(cfg, self.stage_index, [p.shape for p in self.stage.parameters()],
                                               self.admission.key)

        self.server = NodeServer(cfg.network.host, cfg.network.port, admission=self.admission.interceptor,
                                 credentials=self.links.certificate.server_credentials(),
                                 max_concurrent_rpcs=cfg.security.max_concurrent_rpcs)
        self.client = StageClient(run_id=cfg.run.run_id, manifest_hash=self.manifest_hash, codec=cfg.pipeline.activation_codec,
                                  timeout_s=cfg.timeouts.rpc_s, observe=self._observe_rpc, dialer=self.links.dialer)
        if self.directory is None:
            await self._start_directory()
        self.peer_id = self.directory.peer_id
        self.links.set_lookup(contact_lookup(self.directory))
        shape = StageShape(stage=self.stage_index, num_stages=cfg.pipeline.num_stages, hidden_size=llama.hidden_size,
                           seq_len=m.seq_len, microbatch_size=cfg.pipeline.microbatch_size, vocab_size=len(self.tokenizer))
        self.bans = Bans()
        self.runtime = StageRuntime(
            shape=shape, worker=self.worker, compute=self.compute, transport=GrpcStageTransport(self.client),
            directory=DhtReplicas(self.directory), router=Router(self.bans, random.Random(self.peer_id),
                                                                         by_capacity=cfg.pipeline.routing == "capacity"),
            me=Hop(self.peer_id, "", self.stage_index), max_in_flight=cfg.pipeline.max_in_flight,
            send_deadline_s=cfg.timeouts.rpc_s, delay_before_forward_s=cfg.faults.delay_before_forward_s, faults=self.faults,
            routing="balanced" if cfg.outer.method in ("dp", "diloco") else cfg.pipeline.routing,
            routing_seed=cfg.run.seed)
        max_bytes = cfg.pipeline.microbatch_size * m.seq_len * llama.hidden_size * 4
        self.servicer = StageServicer(self.runtime, run_id=cfg.run.run_id, manifest_hash=self.manifest_hash,
                                      max_payload_bytes=max_bytes, receive_s=cfg.timeouts.receive_s,
                                      min_bytes_per_s=cfg.security.min_receive_bytes_per_s,
                                      rms_factor=cfg.security.payload_rms_factor, max_abs=cfg.security.payload_max_abs)
        self.server.add_stage(self.servicer)
        if cfg.outer.method == "noloco":
            self._build_sync(max_bytes=sum(p.numel() * 16 for p in self.stage.parameters()))
        elif cfg.outer.method == "dp":
            from noloco_node.sync.dp import DataParallelStep

            # Stage 0's driver steps at its batch boundary and reports its steps itself.
            self.dp_step = DataParallelStep(worker=self.worker, compute=self.compute, all_reduce=self.all_reduce,
                                            timeout_s=2 * cfg.timeouts.match_s + 10,
                                            after_step=self._on_inner_step if self.stage_index > 0 else None)
            if self.stage_index > 0:
                self.runtime.dp_step = self.dp_step
        elif cfg.outer.method == "diloco":
            from noloco_node.sync.diloco import DiLoCoSync

            self.outer_state = OuterState(self.stage.named_parameters(), alpha=cfg.outer.alpha, beta=cfg.outer.beta)
            self.sync = DiLoCoSync(self.outer_state, all_reduce=self.all_reduce, compute=self.compute,
                                   timeout_s=2 * cfg.timeouts.match_s + 10)
            self.runtime.on_inner_step = self._on_inner_step
        from noloco_node.rpc.diagnostics import DiagnosticsServicer

        self.server.add_diagnostics(DiagnosticsServicer(run_id=cfg.run.run_id, version=__version__,
                                                        manifest_hash=self.manifest_hash, timeout_s=cfg.timeouts.connect_s))
        port = await self.server.start()
        await self.links.attach(self.directory.p2p, self.server.bridge_port, self.server.tls_target)
        self.address = announced_address(cfg.network.host, port, cfg.network.announce_addr,
                                         await self.directory.visible_maddrs())
        await settle_reach(self.directory, self.links, cfg, address=self.address, server=self.server)
        self.runtime.me = Hop(self.peer_id, self.address, self.stage_index)
        self.metrics_port = None
        if cfg.network.metrics_port is not None:
            from noloco_node.node.metrics import NodeMetrics

            self.metrics = NodeMetrics(self.stats, peer_id=self.peer_id, stage=self.stage_index)
            self.metrics_port = self.metrics.serve(cfg.network.host, cfg.network.metrics_port)
        self.fetched_state = None
        self.resumed_from = None
        if cfg.outer.method != "dp" and self.stage_index > 0:
            # Checkpoints, events, snapshots (and outer steps) for every method; stage 0's driver
            # and the dp step call the hook themselves.
            self.runtime.on_inner_step = self._on_inner_step
        if cfg.checkpoint.dir is not None:
            self.resumed_from = await self._resume()
        if self.resumed_from is None and isinstance(self.sync, NoLoCoSync):
            self.fetched_state = await fetch_state(self.directory, self.outer_client, self.compute, self.outer_state,
                                                   self.worker.inner, stage=self.stage_index, peer_id=self.peer_id,
                                                   timeout_s=cfg.timeouts.rpc_s)
            if self.fetched_state is not None:
                self.outer_round = self.fetched_state["outer_round"]
        self.status = "serving"
        await self.announce()
        self._spawn(self._heartbeat())
        if self.movable:
            self._spawn(self._watch_balance())
        if self.snapshot_every:
            await self.save_snapshot(self.worker.inner_steps)
        self.events.bind(peer=self.peer_id, stage=self.stage_index)
        self.events.emit("started", address=self.address, manifest_hash=self.manifest_hash, method=cfg.outer.method,
                         resumed_from=self.resumed_from, fetched_state=self.fetched_state)
        log.info("stage %d serving at %s (peer %s, manifest %s)", self.stage_index, self.address, self.peer_id, self.manifest_hash)

    async def _start_directory(self) -> None:
        cfg = self.config
        self.directory = await PeerDirectory.start(
            DirectoryIdentity(cfg.run.run_id, self.manifest_hash, __version__, cfg.pipeline.num_stages),
            initial_peers=list(cfg.network.initial_peers), host=cfg.network.host, port=cfg.network.dht_port,
            startup_timeout_s=cfg.timeouts.startup_s, swarm_key=self.admission.key,
            max_skew_s=cfg.security.max_clock_skew_s, key=self.links.identity)

    async def _choose_stage(self) -> int:
        """`--stage auto`: the stage of our own checkpoint if there is exactly one, else the stage
        that sustains the least (runtime/throughput.py: weakest_stage)."""
        cfg = self.config
        if cfg.checkpoint.dir is not None:
            from noloco_node.node.checkpoint import stages_in

            stages = stages_in(Path(cfg.checkpoint.dir).expanduser(), cfg.run.run_id)
            if len(stages) == 1:
                log.info("stage auto: resuming stage %d from the checkpoint in %s", stages[0], cfg.checkpoint.dir)
                return stages[0]
        await self._start_directory()
        stage = await claim_stage_in(self.directory, self.claim_record, ttl_s=cfg.timeouts.record_ttl_s)
        log.info("stage auto: replicas' capacities per stage %s -> serving stage %d",
                 await self.directory.replica_capacities(), stage)
        return stage

    def claim_record(self, stage: int, status: str, claimed_at: float) -> StageRecord:
        """A joiner's claim on a stage (pipeline/stage_choice.py): no address yet, never routed to."""
        return StageRecord(peer_id=self.directory.peer_id, address="", stage=stage, inner_step=0, outer_round=0,
                           status=status, tokens_per_s=0.0, version=__version__, manifest_hash=self.manifest_hash,
                           run_id=self.config.run.run_id, updated_at=claimed_at)

    def _build_sync(self, max_bytes: int) -> None:
        cfg = self.config
        self.outer_state = OuterState(self.stage.named_parameters(), alpha=cfg.outer.alpha, beta=cfg.outer.beta,
                                      gamma=cfg.outer.gamma)
        self.outer_traffic = Traffic()
        self.outer_client = OuterClient(run_id=cfg.run.run_id, manifest_hash=self.manifest_hash, max_bytes=max_bytes,
                                        traffic=self.outer_traffic, faults=self.faults, dialer=self.links.dialer)
        self.sync = NoLoCoSync(self.outer_state, client=self.outer_client, directory=DhtMatching(self.directory),
                               compute=self.compute, peer_id=self.peer_id, stage=self.stage_index, codec=cfg.outer.codec_phi,
                               match_s=cfg.timeouts.match_s, max_distance_ratio=cfg.outer.max_distance_ratio,
                               bans=Bans(), set_status=self._set_status, rng=random.Random(self.peer_id + "outer"),
                               faults=self.faults, codec_delta=cfg.outer.codec_delta)
        self.server.add_outer(OuterServicer(self.sync, run_id=cfg.run.run_id, manifest_hash=self.manifest_hash,
                                            stage=self.stage_index, max_bytes=max_bytes, timeout_s=cfg.timeouts.match_s,
                                            traffic=self.outer_traffic, donor=self, faults=self.faults))
        self.runtime.on_inner_step = self._on_inner_step

    async def export_state(self) -> tuple[dict, str]:
        """rpc.StateDonor: a consistent copy of our state, taken on the compute thread."""
        tensors, counters = await self.compute.run(export_state, self.outer_state, self.worker.inner,
                                                   inner_step=self.worker.inner_steps)
        return tensors, counters_json(counters)

    async def _set_status(self, status: str, round_index: int) -> None:
        self.status, self.outer_round = status, round_index
        await self.announce()

    async def _on_inner_step(self, inner_step: int) -> None:
        """Every H inner steps the outer step (one at a time); every K a checkpoint."""
        self._emit_inner_step(inner_step)
        if self.sync is not None and inner_step % self.config.outer.inner_steps_per_outer == 0:
            async with self._outer_lock:
                await self.sync.outer_step(inner_step, inner_step // self.config.outer.inner_steps_per_outer)
            if self.sync.counters.history:
                self.events.emit("outer_round", inner_step=inner_step, **self.sync.counters.history[-1])
        if self.config.checkpoint.dir is not None and inner_step % self.config.checkpoint.every_steps == 0:
            await self.save_checkpoint()
        if self.snapshot_every and inner_step % self.snapshot_every == 0:
            await self.save_snapshot(inner_step)

    async def save_snapshot(self, inner_step: int, *, final: bool = False) -> None:
        from noloco_node.node.outputs import save_snapshot

        await save_snapshot(self, inner_step, final=final)

    async def save_checkpoint(self) -> None:
        from noloco_node.node import checkpoint

        outer = getattr(self, "outer_state", None)
        tensors, counters = await self.compute.run(checkpoint.collect, self.stage, self.worker.inner, outer)
        if self.driver is not None:  # taken between batches: every microbatch so far is completed or dropped
            c = self.driver.counters
            counters["microbatches"] = {"issued": c.issued, "completed": c.completed, "dropped": c.dropped,
                                        "reissued": c.reissued}
        identity = {"run_id": self.config.run.run_id, "manifest_hash": self.manifest_hash, "peer_id": self.peer_id}
        path = await asyncio.to_thread(checkpoint.save, Path(self.config.checkpoint.dir).expanduser(), self.stage_index,
                                       tensors, counters, identity)
        log.info("checkpoint at inner step %d: %s", counters["inner_step"], path)
        self.events.emit("checkpoint", inner_step=counters["inner_step"], file=str(path))

    def _emit_inner_step(self, inner_step: int) -> None:
        fields = {"inner_step": inner_step, "lr": self.worker.last_lr, "tokens": self.worker.tokens_total,
                  "bytes_sent": self.client.bytes_sent + self.outer_bytes_sent(), "idle_s": round(self.compute.idle_s, 4),
                  "busy_s": round(self.compute.busy_s, 4)}
        if self.driver is not None and self.driver.log.step_losses:
            fields["loss"] = self.driver.log.step_losses[-1]
            fields["lr"] = self.driver.log.lrs[-1]
        self.events.emit("inner_step", **fields)

    def outer_bytes_sent(self) -> int:
        if self.all_reduce is not None:
            return self.all_reduce.bytes_sent
        traffic = getattr(self, "outer_traffic", None)
        return traffic.bytes_sent if traffic is not None else 0

    async def _resume(self) -> dict | None:
        from noloco_node.node import checkpoint

        found = await asyncio.to_thread(checkpoint.load, Path(self.config.checkpoint.dir).expanduser(), self.stage_index)
        if found is None:
            return None
        tensors, meta = found
        if meta.get("run_id") != self.config.run.run_id or meta.get("manifest_hash") != self.manifest_hash:
            log.warning("ignoring the checkpoint in %s: it belongs to run %s / manifest %s", self.config.checkpoint.dir,
                        meta.get("run_id"), meta.get("manifest_hash"))
            return None
        await self.compute.run(checkpoint.restore, self.stage, self.worker.inner, getattr(self, "outer_state", None),
                               tensors, meta)
        self.outer_round = int(meta["outer_round"])
        log.info("resumed from checkpoint at inner step %d", meta["inner_step"])
        return {"inner_step": int(meta["inner_step"]), "outer_round": self.outer_round, "file": meta["file"],
                "microbatches": meta.get("microbatches")}

    def _observe_rpc(self, method: str, seconds: float) -> None:
        if method == "Forward":
            self.meter.observe_hop(seconds)
        if self.metrics is not None:
            self.metrics.observe_rpc(method, seconds)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def tokens_per_s(self) -> float:
        """Tokens this stage processed per second since it started."""
        return float(self.worker.tokens_total / max(1e-6, time.monotonic() - self.started_at))

    def record(self) -> StageRecord:
        return StageRecord(peer_id=self.peer_id, address=self.address, stage=self.stage_index,
                           inner_step=self.worker.inner_steps, outer_round=self.outer_round, status=self.status,
                           tokens_per_s=self.tokens_per_s, version=__version__,
                           manifest_hash=self.manifest_hash, run_id=self.config.run.run_id, updated_at=time.time(),
                           reach=self.links.update_reach(), tls_cert=self.links.certificate.b64,
                           p2p_addrs=self.links.p2p_addrs[:16], movable=self.movable,
                           moved_at=float(self.moves[-1]["at"]) if self.moves else 0.0, **self.meter.record_fields())

    async def announce(self, ttl_s: float | None = None) -> None:
        await self.directory.announce(self.record(), ttl_s=ttl_s or self.config.timeouts.record_ttl_s)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.timeouts.heartbeat_s)
            try:
                self.meter.sample(sequences=self.worker.sequences_total, busy_s=self.compute.busy_s,
                                  in_flight=len(self.runtime.in_flight), window=self.config.pipeline.max_in_flight)
                await self.announce()
                await self.runtime.expire_saved()
                if self.links.reach != "direct" and self.links.bridge is not None:  # behind NAT: see joining.py
                    await self.links.bridge.dial_out(await public_libp2p_addrs(self.directory, self.config.pipeline.num_stages))
            except Exception:  # noqa: BLE001 - a failed heartbeat is retried next period
                log.exception("heartbeat failed")

    async def _watch_balance(self) -> None:
        """Rebalancing (pipeline/rebalance.py): when the plan names this node, ask the join command to
        move it (it drains, leaves and comes back on the target stage)."""
        p = self.config.pipeline
        self.move = await watch(me=self.peer_id, read=lambda: swarm_replicas(self.directory), num_stages=p.num_stages,
                                margin=p.rebalance_margin, period_s=p.rebalance_period_s, settle_s=2 * p.rebalance_period_s,
                                cooldown_s=10 * p.rebalance_period_s)
        self.events.emit("move_planned", source=self.move.source, target=self.move.target,
                         throughput_now=self.move.throughput_now, throughput_after=self.move.throughput_after)
        self.move_requested.set()

    async def wait_for_replicas(self, count: int, timeout_s: float) -> None:
        """Block until every stage shows at least `count` live replicas (or raise TimeoutError)."""
        await wait_for_replicas(self.directory, self.config.pipeline.num_stages, count, timeout_s)

    async def train(self, steps: int, on_inner_step=None) -> None:
        """Stage 0 only: run `steps` inner steps over this replica's data shard; `on_inner_step(step)`
        is awaited after each (the outer step hooks in here)."""
        from noloco_node.data.loader import PackedSequences, ShardSpec

        cfg = self.config
        replicas = await self.directory.replicas(0, fresh=True)
        ids = sorted(r.peer_id for r in replicas)
        shard = ShardSpec(shard_index=ids.index(self.peer_id) if self.peer_id in ids else 0, num_shards=max(1, len(ids)))
        batches = PackedSequences(self.corpus, self.tokenizer, seq_len=cfg.model.seq_len, shard=shard,
                                  holdout_fraction=cfg.data.holdout_fraction, seed=cfg.run.seed,
                                  shuffle_buffer=0 if self.sequential else 1000).batches(cfg.pipeline.batch_size)
        self.driver = Stage0Driver(self.runtime, batches, microbatch_size=cfg.pipeline.microbatch_size,
                                   microbatch_timeout_s=self.microbatch_timeout_s, sequential=self.sequential,
                                   step_fn=self.dp_step, overlap=cfg.pipeline.schedule == "overlap")
        restored = (self.resumed_from or {}).get("microbatches")
        if restored:  # a restarted driver carries on its predecessor's accounting from the checkpoint
            for name, value in restored.items():
                setattr(self.driver.counters, name, int(value))
        async def after_step(step: int) -> None:
            await self._on_inner_step(step)
            if on_inner_step is not None:
                await on_inner_step(step)

        await self.driver.run(steps, after_step)

    def stats(self) -> dict:
        from noloco_node.node.outputs import node_stats

        return node_stats(self)

    async def stop(self, grace_s: float | None = None, *, final: bool = True) -> None:
        """Withdraw the DHT record (status leaving), finish a running outer step, drain the
        microbatches in flight within `grace_s`, checkpoint, write stats (and weights), shut down.
        `final=False` (a move to another stage): no checkpoint, snapshot or outputs of this stage."""
        grace_s = self.config.timeouts.drain_s if grace_s is None else grace_s
        self.status = "leaving"
        self.events.emit("stopping", inner_step=self.worker.inner_steps, in_flight=len(self.runtime.in_flight))
        # A mover's leaving record outlives its trip to the new stage (a restart, a state fetch), so
        # no other node plans a move while this one is in transit (pipeline/rebalance.py).
        ttl_s = None if final else max(self.config.timeouts.record_ttl_s, 2 * self.config.pipeline.rebalance_period_s)
        try:  # withdraw first, so peers stop routing to us while we drain
            await asyncio.wait_for(self.announce(ttl_s), timeout=self.config.timeouts.connect_s)
        except Exception:  # noqa: BLE001 - leaving anyway; the record expires by TTL
            pass
        try:  # let a running outer step finish, so the weights we save are post-update
            await asyncio.wait_for(self._outer_lock.acquire(), timeout=2 * self.config.timeouts.match_s + 10)
            self._outer_lock.release()
        except asyncio.TimeoutError:
            log.warning("an outer step was still running at shutdown")
        await self.runtime.drain(grace_s)
        if self.snapshot_every and final:  # where training left this node, whatever inner step that is
            await self.save_snapshot(self.worker.inner_steps, final=True)
        if self.config.checkpoint.dir is not None and final:
            await self.save_checkpoint()
        for task in list(self._background):
            task.cancel()
        if self.out_dir is not None and final:
            self.write_outputs(self.out_dir)
        if isinstance(self.sync, NoLoCoSync):
            await self.outer_client.close()
        if self.all_reduce is not None:
            await asyncio.to_thread(self.all_reduce.shutdown)
        for name, step in (("server", self.server.stop(1.0)), ("client", self.client.close()),
                           ("links", self.links.close()), ("dht", self.directory.shutdown())):
            try:
                await asyncio.wait_for(step, timeout=self.config.timeouts.connect_s + 5)
            except asyncio.TimeoutError:
                log.warning("shutdown of the %s timed out; exiting anyway", name)
        if self.metrics is not None:
            self.metrics.stop()
        self.compute.shutdown()
        self.events.emit("stopped", inner_step=self.worker.inner_steps, saved_inputs=len(self.worker.saved))
        self.events.close()

    def write_outputs(self, out_dir: Path) -> None:
        from noloco_node.node.outputs import write_outputs

        write_outputs(self, out_dir)

