"""A whole swarm in one process, on one event loop: every replica of every stage assembled exactly
as a real node is (node/assembly.py), over the in-memory twins of the ports (pipeline/memory.py,
sync/memory.py) instead of gRPC and the DHT. Each replica keeps its own compute thread.

What it is for: the fast test tier checks the logic of the pipeline and the outer sync (the
microbatch lifecycle, NoLoCo pairing and exchange, the overlap schedule, equivalence with the
single-process oracle) on real parts in seconds; `noloco-node demo --local` trains it
(node/local_run.py). What only processes show (transport, TLS, NAT, signals, the CLI) stays in
tests/integration/.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from noloco_node.config import NodeConfig
from noloco_node.data.loader import ShardSpec, training_batches
from noloco_node.model.build import run_model
from noloco_node.node.assembly import AssemblyPorts, ComputeParts, PipelineParts, assemble, build_compute, build_driver
from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.node.waiting import wait_for_replicas
from noloco_node.node.manifest import load_run_inputs
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.pipeline.ports import Hop
from noloco_node.runtime.compute import compute_device
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.sync.factory import SyncPorts
from noloco_node.sync.memory import MemoryAllReduceHub, MemoryPairingHub
from noloco_node.sync.ports import OuterSync


@dataclass
class InProcessNode:
    peer_id: str
    replica: int
    config: NodeConfig
    parts: ComputeParts
    sync: OuterSync
    pipeline: PipelineParts
    boundary: InnerStepBoundary
    events: EventLog
    driver: Stage0Driver | None = None

    @property
    def stage(self) -> int:
        return self.parts.shape.stage

    @property
    def worker(self):
        return self.parts.worker

    @property
    def runtime(self):
        return self.pipeline.runtime

    def weights(self) -> dict:
        return {n: p.detach().clone() for n, p in self.parts.stage.named_parameters()}


class InProcessSwarm:
    """`replicas` replicas of every stage of `config`'s pipeline. `config_for(stage, replica)`
    may give a replica a config of its own (faults, delays); by default all share `config`."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        replicas: int,
        codec: str | None = None,
        config_for: Callable[[int, int], NodeConfig] | None = None,
    ) -> None:
        self.config, self.replicas = config, replicas
        self.config_for = config_for or (lambda stage, replica: config)
        self.network = MemoryNetwork(
            codec=codec or config.pipeline.activation_codec,
            gradient_codec=codec or config.pipeline.gradient_codec,
            pinned_receive=compute_device(config.pipeline.device).type == "cuda",
        )
        self.hub = MemoryPairingHub()
        self.all_reduce = {stage: MemoryAllReduceHub(replicas) for stage in range(config.pipeline.num_stages)}
        """Per stage, for diloco and dp: tests may inject partial or missed rounds into it."""
        self.nodes: list[InProcessNode] = []

    def stage(self, index: int) -> list[InProcessNode]:
        return [n for n in self.nodes if n.stage == index]

    async def start(self) -> InProcessSwarm:
        self.corpus, self.tokenizer, self.manifest_hash = load_run_inputs(self.config)
        llama, ranges = run_model(self.config, len(self.tokenizer))
        for stage in range(self.config.pipeline.num_stages):
            for replica in range(self.replicas):
                self.nodes.append(self._assemble(stage, replica, llama, ranges))
        return self

    def _assemble(self, stage: int, replica: int, llama, ranges: list[range]) -> InProcessNode:
        config = self.config_for(stage, replica)
        peer_id = f"s{stage}r{replica}"
        events, faults = EventLog(config.log.events_file), FaultInjector(config.faults.inject)
        events.bind(peer=peer_id, stage=stage)
        parts = build_compute(
            config, llama, ranges, stage, vocab_size=len(self.tokenizer), events=events, faults=faults
        )
        pairing, transport = self.hub.transport(peer_id, faults), self.network.transport(peer_id)

        async def set_status(status: str, round_index: int) -> None:
            await self.network.set_status(peer_id, status, round_index)

        ports = AssemblyPorts(
            sync=SyncPorts(
                pairing=pairing,
                matching=self.network.directory(),
                all_reduce=self.all_reduce[stage].member(peer_id),
                progress=self.network.directory(),
            ),
            transport=transport,
            directory=self.network.directory(),
            me=Hop(peer_id, f"memory:{peer_id}", stage),
            set_status=set_status,
        )
        assembly = assemble(config, parts, ports, events=events, faults=faults)
        sync, boundary, pipeline = assembly.sync, assembly.boundary, assembly.pipeline
        self.network.register(peer_id, stage, pipeline.runtime, inner_steps=lambda: parts.worker.inner_steps)
        self.hub.register(peer_id, sync.responder)
        return InProcessNode(peer_id, replica, config, parts, sync, pipeline, boundary, events)

    def batches(self, node: InProcessNode):
        shard = ShardSpec(shard_index=node.replica, num_shards=self.replicas)
        return training_batches(node.config, self.corpus, self.tokenizer, shard)

    async def train(
        self, steps: int, timeout_s: float = 120.0, on_inner_step: Callable[[InProcessNode, int], None] | None = None
    ) -> None:
        """Every stage-0 replica drives `steps` inner steps; all run at once on this event loop.
        `on_inner_step(node, step)` is called after each stage-0 node's boundary."""
        drivers = []
        directory, later = self.network.directory(), range(1, self.config.pipeline.num_stages)
        for node in self.stage(0):
            node.driver = build_driver(
                node.config,
                node.pipeline,
                node.sync,
                self.batches(node),
                # As a process node's (node/lifecycle.py): a batch waits while a later stage has nobody.
                before_batch=lambda: wait_for_replicas(directory, later, 1, lambda _: None, poll_s=0.02),
            )
            drivers.append(node.driver.run(steps, _boundary_of(node, on_inner_step)))
        # asyncio.timeout, not wait_for: a cancelled wait_for leaves the gather's CancelledError
        # unretrieved (Python 3.11), which asyncio then logs as an error.
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*drivers)

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Let outer rounds under way finish and the microbatches in flight drain."""
        for node in self.nodes:
            await node.sync.settle(timeout_s)
        for node in self.nodes:
            await node.runtime.drain(timeout_s)

    async def stop(self) -> None:
        await self.settle()
        for node in self.nodes:
            await node.sync.close()
            node.parts.compute.shutdown()
            node.events.close()

    async def __aenter__(self) -> InProcessSwarm:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def replica_spread(self) -> float:
        """RMS deviation of each replica's weights from its stage's replica mean, over all parameters."""
        total, count = 0.0, 0
        with torch.no_grad():
            for stage in range(self.config.pipeline.num_stages):
                rows = [list(n.parts.stage.parameters()) for n in self.stage(stage)]
                for group in zip(*rows):
                    stacked = torch.stack([p.detach().double().cpu() for p in group])
                    total += float((stacked - stacked.mean(0)).pow(2).sum())
                    count += stacked.numel()
        return math.sqrt(total / count) if count else 0.0

    @torch.no_grad()
    def validation_loss(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        """Mean loss of the columns: replica d of every stage, chained, on `batches` (not the
        compute threads: call it while no training runs)."""
        losses = []
        for replica in range(self.replicas):
            column = [n for n in self.nodes if n.replica == replica]
            column.sort(key=lambda n: n.stage)
            for inputs, labels in batches:
                x = inputs.to(column[0].parts.device)
                for node in column[:-1]:
                    x = node.parts.stage(x.to(node.parts.device), inputs.to(node.parts.device))
                last = column[-1].parts
                losses.append(float(last.stage(x.to(last.device), inputs.to(last.device), labels.to(last.device))))
        return sum(losses) / len(losses)

    def routes(self) -> dict[str, dict[str, int]]:
        """Per node past stage 0: forwards received from each upstream peer."""
        return {n.peer_id: dict(sorted(n.runtime.stats.forwards_received.items())) for n in self.nodes if n.stage > 0}

    def outer_rounds(self) -> dict[str, int]:
        """Each node's outer counters (node/stats.py's "outer"), summed over the swarm."""
        counters = [{k: v for k, v in vars(n.sync.counters).items() if k != "history"} for n in self.nodes]
        return {k: sum(c[k] for c in counters) for k in counters[0]} if counters else {}


def _boundary_of(node: InProcessNode, on_inner_step: Callable[[InProcessNode, int], None] | None = None):
    async def after_step(step: int) -> None:
        await node.boundary(step, node.driver)
        if on_inner_step is not None:
            on_inner_step(node, step)

    return after_step
