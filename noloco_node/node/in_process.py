"""A whole swarm in one process, on one event loop: every replica of every stage assembled exactly
as a real node is (node/assembly.py), over the in-memory twins of the ports (pipeline/memory.py,
sync/memory.py) instead of gRPC and the DHT. Each replica keeps its own compute thread.

What it is for: the fast test tier checks the logic of the pipeline and the outer sync (the
microbatch lifecycle, NoLoCo pairing and exchange, the overlap schedule, equivalence with the
single-process oracle) on real parts in seconds. What only processes show (transport, TLS, NAT,
signals, the CLI) stays in tests/integration/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from noloco_node.config import NodeConfig
from noloco_node.data.loader import ShardSpec, training_batches
from noloco_node.model.build import run_model
from noloco_node.node.assembly import ComputeParts, PipelineParts, build_compute, build_driver, build_pipeline, build_sync
from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.node.manifest import load_run_inputs
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.pipeline.ports import Hop
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

    def __init__(self, config: NodeConfig, *, replicas: int, codec: str | None = None,
                 config_for: Callable[[int, int], NodeConfig] | None = None) -> None:
        self.config, self.replicas = config, replicas
        self.config_for = config_for or (lambda stage, replica: config)
        self.network = MemoryNetwork(codec=codec or config.pipeline.activation_codec,
                                     gradient_codec=codec or config.pipeline.gradient_codec)
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
        parts = build_compute(config, llama, ranges, stage, vocab_size=len(self.tokenizer), events=events, faults=faults)
        pairing = self.hub.transport(peer_id, faults)
        ports = SyncPorts(pairing=pairing, matching=self.network.directory(),
                          all_reduce=self.all_reduce[stage].member(peer_id), progress=self.network.directory())

        async def set_status(status: str, round_index: int) -> None:
            await self.network.set_status(peer_id, status, round_index)

        sync = build_sync(config, parts, ports, peer_id=peer_id, set_status=set_status, events=events, faults=faults)
        transport = self.network.transport(peer_id)
        boundary = InnerStepBoundary(worker=parts.worker, sync=sync, events=events, compute=parts.compute,
                                     stage_index=stage, bytes_sent=lambda: transport.bytes_sent + pairing.bytes_sent)
        pipeline = build_pipeline(config, parts, transport=transport, directory=self.network.directory(),
                                  me=Hop(peer_id, f"memory:{peer_id}", stage), sync=sync, on_inner_step=boundary,
                                  faults=faults)
        self.network.register(peer_id, stage, pipeline.runtime, inner_steps=lambda: parts.worker.inner_steps)
        self.hub.register(peer_id, sync.responder)
        return InProcessNode(peer_id, replica, config, parts, sync, pipeline, boundary, events)

    def batches(self, node: InProcessNode):
        shard = ShardSpec(shard_index=node.replica, num_shards=self.replicas)
        return training_batches(node.config, self.corpus, self.tokenizer, shard)

    async def train(self, steps: int, timeout_s: float = 120.0) -> None:
        """Every stage-0 replica drives `steps` inner steps; all run at once on this event loop."""
        drivers = []
        for node in self.stage(0):
            node.driver = build_driver(node.config, node.pipeline, node.sync, self.batches(node))
            drivers.append(node.driver.run(steps, _boundary_of(node)))
        await asyncio.wait_for(asyncio.gather(*drivers), timeout_s)

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


def _boundary_of(node: InProcessNode):
    async def after_step(step: int) -> None:
        await node.boundary(step, node.driver)
    return after_step
