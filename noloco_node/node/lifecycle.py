"""A node's life: created (node/building.py builds and wires its parts, then it serves, finds out
how peers reach it, takes up its state and announces itself), heartbeat, train (stage 0), stop
(withdraw, drain, checkpoint, outputs) and moving to another stage. This module orders the steps."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from noloco_node.config import NodeConfig
from noloco_node.dht.records import StageRecord
from noloco_node.node.assembly import PipelineParts, build_driver
from noloco_node.node.attention import Progress
from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.node.catching_up import RECOPY, Recopy, watch_behind
from noloco_node.node.building import BuiltNode, NodeBasics, build_node
from noloco_node.node.joining import Reprobe, settle_reach
from noloco_node.node.state_copy import fetch_state
from noloco_node.node.waiting import wait_for_replicas
from noloco_node.node.leaving import abandon, leave
from noloco_node.node.presence import heartbeat, watch_balance
from noloco_node.node.wiring import SnapshotOutputs
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.rebalance import Move
from noloco_node.runtime.memory import tune_allocator
from noloco_node.runtime.node_stats import NodeStats
from noloco_node.runtime.node_status import Status
from noloco_node.runtime.recent_rate import RecentRate
from noloco_node.sync.factory import method_traits
from noloco_node.sync.ports import OuterSync
from noloco_node.transport.identity import NodeIdentity

if TYPE_CHECKING:
    from noloco_node.node.dashboard import NodeDashboard
    from noloco_node.node.metrics import NodeMetrics

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
    """A running node of the swarm. Only `Node.create` makes one: a node that exists is wired,
    serving its stage and announced."""

    def __init__(
        self,
        config: NodeConfig,
        basics: NodeBasics,
        built: BuiltNode,
        *,
        outputs: NodeOutputs,
        moves: list[dict],
    ) -> None:
        """Keeps what `create` built; does nothing else. Only a method whose traits say so moves
        between stages (NoLoCo): the mover needs a replica's state (FetchState), and the
        all-reduce baselines' groups have a fixed size."""
        self.config, self.outputs = config, outputs
        self.traits = method_traits(config.outer.method)
        self.identity, self.events, self.faults = basics.identity, basics.events, basics.faults
        self.meter, self.board, self.rpc_timings = basics.meter, basics.board, basics.rpc
        self.board.publish_with(self.announce)
        self.moves = list(moves)
        rebalance = config.pipeline.rebalance
        self.movable = (
            (config.pipeline.stage is None if rebalance is None else rebalance)
            and config.pipeline.num_stages > 1
            and self.traits.movable
        )
        self.move: Move | Recopy | None = None
        self.move_claimed_at = 0.0
        self.move_requested = asyncio.Event()
        self.started_at = time.monotonic()
        self.progress = Progress()
        self.stage_replicas: int | None = None  # live replicas of our stage, ours included (heartbeat)
        self.done_at_step: int | None = None  # stage 0 trained all its steps and only serves now
        self.run_finished_at: int | None = None  # a later stage saw stage 0 train all of them (presence.py)
        self.stopping = False  # leave() has begun (node/leaving.py)
        self.corpus, self.tokenizer, self.manifest_hash = built.corpus, built.tokenizer, built.manifest_hash
        self.stage_index, self.parts, self.directory = built.stage_index, built.parts, built.directory
        self.peer_id = built.directory.peer_id
        self.links, self.admission = built.links, built.admission
        self.server, self.address = built.server, built.address
        services = built.services
        self.client, self.outer_client = services.client, services.outer_client
        self.outer_traffic = services.outer_traffic
        self.checkpoints, self.snapshots = services.checkpoints, services.snapshots
        self.sync: OuterSync = services.sync
        self.boundary: InnerStepBoundary = services.boundary
        self.pipeline: PipelineParts = services.pipeline
        self.servicer = services.servicer
        self.driver: Stage0Driver | None = None  # stage 0, once it trains
        self.recent_tokens = RecentRate(self.parts.worker.tokens_total)
        self.reprobe: Reprobe | None = None
        self.metrics: NodeMetrics | None = None
        self.metrics_port: int | None = None
        self.dashboard: NodeDashboard | None = None
        self.fetched_state: dict | None = None
        self.resumed_from: dict | None = None
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def create(
        cls, config: NodeConfig, *, outputs: NodeOutputs = NodeOutputs(), membership: Membership | None = None
    ) -> Node:
        """Build every part (node/building.py), then serve, find out how peers reach us, take up
        our state (our checkpoint, or a replica's) and announce ourselves. A node that moved
        between stages keeps its identity (peer id) and the record of its moves. A start that
        fails closes what it had opened and raises."""
        tune_allocator()
        membership = membership or Membership()
        basics = NodeBasics.for_config(config, membership.identity)
        snapshots = SnapshotOutputs(outputs.snapshot_every, outputs.snapshot_dir)
        built = await build_node(config, basics, method_traits(config.outer.method), snapshots)
        node = cls(config, basics, built, outputs=outputs, moves=membership.moves)
        try:
            await node._go_live()
        except BaseException:
            await abandon(node)
            raise
        return node

    async def _go_live(self) -> None:
        await self._serve()
        await self._join_state()
        self.board.become(Status.SERVING)
        await self.announce()
        self.spawn(heartbeat(self))
        if self.movable:
            self.spawn(watch_balance(self))
        if self.traits.donates_state:
            self.spawn(watch_behind(self))
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

    async def _serve(self) -> None:
        """Start the services, find out how peers reach us, and open /metrics and the node page."""
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
            self.rpc_timings.sinks.append(self.metrics.observe_rpc)
        if cfg.network.dashboard is not None:
            from noloco_node.node.dashboard import NodeDashboard

            self.dashboard = await NodeDashboard.open(self)

    async def _join_state(self) -> None:
        """Take up the newest state there is: our own checkpoint, unless (a method whose replicas
        donate state: NoLoCo) a live replica of the stage is further on, then a copy of its state;
        the checkpoint again if no replica could give one. A node that came back to copy its
        stage's state (node/catching_up.py) copies it, whatever its checkpoint says."""
        recopy = bool(self.moves) and self.moves[-1].get("why") == RECOPY
        if not recopy and await self._checkpoint_is_newest():
            await self._resume()
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
                round_steps=self.config.outer.inner_steps_per_outer,
            )
            if self.fetched_state is not None:
                self.sync.start_at(self.fetched_state["outer_round"])
            elif self.checkpoints is not None:
                await self._resume()

    async def _checkpoint_is_newest(self) -> bool:
        if self.checkpoints is None or (saved := await self.checkpoints.saved_step(self.stage_index)) is None:
            return False
        if not self.traits.donates_state:
            return True
        from noloco_node.node.discovery import checkpoint_margin, live_step_ahead

        margin = checkpoint_margin(self.config)
        ahead = await live_step_ahead(self.directory, self.stage_index, saved, me=self.peer_id, margin=margin)
        if ahead is not None:
            log.info(
                "the checkpoint in %s is at inner step %d, stage %d's live replicas at %d (more than %d steps "
                "on): copying their state",
                self.checkpoints.directory,
                saved,
                self.stage_index,
                ahead,
                margin,
            )
        return ahead is None

    async def _resume(self) -> None:
        self.resumed_from = await self.checkpoints.resume(self.stage_index)
        if self.resumed_from is not None:
            log.info(
                "resumed from checkpoint at inner step %d, outer round %d",
                self.resumed_from["inner_step"],
                self.resumed_from["outer_round"],
            )
            self.sync.start_at(self.resumed_from["outer_round"])

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

    def stats(self) -> dict:
        """The stats file's dict: `read_stats().to_dict()`."""
        return self.read_stats().to_dict()

    def read_stats(self) -> NodeStats:
        """Everything the node reports about itself, typed, each part reporting its own numbers."""
        from noloco_node.node.stats import node_stats

        return node_stats(self)

    @property
    def tokens_per_s(self) -> float:
        """Tokens this stage processed per second over the last minute (runtime/recent_rate.py)."""
        return self.recent_tokens.rate(self.worker.tokens_total)

    # ---- the swarm's view of us ------------------------------------------------------------
    @property
    def status(self) -> Status:
        """What our record says we are doing (the outer sync sets `matching` through the board)."""
        return self.board.status

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
            self.directory,
            range(first, self.config.pipeline.num_stages),
            count,
            self.progress.wait,
            me=(self.stage_index, self.peer_id),
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
        # The last boundary's round may still run (outer.overlap): it is the run's last update, so
        # training ends when it is applied, as long as the round may take by its own deadlines
        # (a stop waits only outer_round_s: CI saw a stage-0 replica end 3 of its 4 rounds).
        bound_s = max(cfg.timeouts.outer_round_s, self.sync.round_bound_s())
        if not await self.sync.settle(bound_s):
            log.warning("the last outer round did not finish within %.0f s", bound_s)

    # ---- stop ------------------------------------------------------------------------------
    async def stop(self, grace_s: float | None = None, *, final: bool = True, same_stage: bool = False) -> None:
        """Finish a running outer step, withdraw the DHT record (status leaving), drain the
        microbatches in flight within `grace_s`, checkpoint, write stats (and weights), shut down.
        `final=False` (a move to another stage): no checkpoint, snapshot or outputs of this stage;
        `same_stage` (a move back to the same stage, node/catching_up.py): the checkpoint all the same."""
        await leave(self, grace_s, final=final, same_stage=same_stage)

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()
