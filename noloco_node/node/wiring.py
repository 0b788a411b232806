"""A node's services, wired once its parts, links and server exist: the stage and outer clients,
the outer-sync method with the boundary and the pipeline (assembly.assemble), checkpoints and
snapshots, and the services its server offers (Stage, Outer when the method pairs or donates
state, Diagnostics). node/building.py calls `wire_services` once, before the node exists."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from noloco_node import __version__
from noloco_node.config import NodeConfig
from noloco_node.dht.directory import PeerDirectory
from noloco_node.node.adapters import DhtMatching, DhtReplicas
from noloco_node.node.assembly import AssemblyPorts, ComputeParts, PipelineParts, assemble
from noloco_node.node.boundary import InnerStepBoundary, Snapshots
from noloco_node.node.checkpoint import Checkpointer
from noloco_node.pipeline.ports import Hop
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterClient, OuterServicer, Traffic
from noloco_node.rpc.server import NodeServer
from noloco_node.rpc.stage_service import StageClient, StageCodecs, StageServicer, ValueScreen
from noloco_node.rpc.stage_transport import GrpcStageTransport
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import DeadlinePolicy, LinkDeadlines, LinkEstimates
from noloco_node.sync.factory import SyncPorts
from noloco_node.sync.ports import OuterSync
from noloco_node.sync.transfer import counters_json, export_state
from noloco_node.transport.links import Links


@dataclass(frozen=True)
class SnapshotOutputs:
    """Experiments: theta every `every` inner steps (and at start) under `folder`; 0 = never."""

    every: int = 0
    folder: Path = Path("snapshots")


@dataclass(frozen=True)
class WiringInputs:
    """What the services are wired from: the node as its peers know it, and what it already runs."""

    config: NodeConfig
    parts: ComputeParts
    manifest_hash: str
    me: Hop
    links: Links
    directory: PeerDirectory
    server: NodeServer
    link_estimates: LinkEstimates


@dataclass(frozen=True)
class NodeHooks:
    """What the services report to: objects made before them (node/building.NodeBasics), never
    the node they will belong to."""

    events: EventLog
    faults: FaultInjector
    observe_rpc: Callable[[str, float], None]
    """each stage call's latency"""
    set_status: Callable[[str, int], Awaitable[None]]
    """(status, outer round) -> announced"""


@dataclass(frozen=True)
class StageStateDonor:
    """sync.ports.StateDonor: what a joiner of our stage copies (phi, momentum, Adam, counters), a
    consistent copy taken on the compute thread between two of its jobs."""

    parts: ComputeParts

    async def export_state(self) -> tuple[dict, str]:
        worker = self.parts.worker
        tensors, counters = await self.parts.compute.run(
            export_state, self.parts.outer_state, worker.inner, inner_step=worker.inner_steps
        )
        return tensors, counters_json(counters)


@dataclass(frozen=True)
class NodeServices:
    client: StageClient
    outer_client: OuterClient
    outer_traffic: Traffic
    checkpoints: Checkpointer | None
    snapshots: Snapshots | None
    sync: OuterSync
    boundary: InnerStepBoundary
    pipeline: PipelineParts
    servicer: StageServicer


def wire_services(
    inputs: WiringInputs, hooks: NodeHooks, snapshots: SnapshotOutputs, all_reduce: object | None
) -> NodeServices:
    """Clients, the outer-sync method, the boundary, the pipeline and the services, in the order
    each needs the one before; the services are registered on `inputs.server` (not started)."""
    cfg, parts = inputs.config, inputs.parts
    # Every call's deadline follows its peer's link, as measured by the meter's estimates (announced).
    deadlines = LinkDeadlines(inputs.link_estimates, DeadlinePolicy.from_timeouts(cfg.timeouts))
    client = StageClient(
        run_id=cfg.run.run_id,
        manifest_hash=inputs.manifest_hash,
        codecs=StageCodecs(cfg.pipeline.activation_codec, cfg.pipeline.gradient_codec),
        timeout_s=cfg.timeouts.rpc_s,
        deadlines=deadlines,
        observe=hooks.observe_rpc,
        dialer=inputs.links.dialer,
    )
    state_bytes = sum(p.numel() * 16 for p in parts.stage.parameters())
    traffic = Traffic()
    outer_client = OuterClient(
        run_id=cfg.run.run_id,
        manifest_hash=inputs.manifest_hash,
        max_bytes=state_bytes,
        traffic=traffic,
        faults=hooks.faults,
        dialer=inputs.links.dialer,
        deadlines=deadlines.floored(cfg.timeouts.match_s),
    )
    stage_directory = DhtMatching(inputs.directory)
    ports = AssemblyPorts(
        sync=SyncPorts(pairing=outer_client, matching=stage_directory, all_reduce=all_reduce, progress=stage_directory),
        transport=GrpcStageTransport(client),
        directory=DhtReplicas(inputs.directory),
        me=inputs.me,
        set_status=hooks.set_status,
    )
    checkpoints, snapshot_writer = _checkpoints(inputs), _snapshots(inputs, snapshots)
    assembly = assemble(
        cfg, parts, ports, events=hooks.events, faults=hooks.faults, checkpoints=checkpoints, snapshots=snapshot_writer
    )
    servicer = _serve_stage(inputs, assembly.pipeline, deadlines)
    if assembly.sync.responder is not None:  # pairing, and state for joiners (traits.donates_state)
        _serve_outer(inputs, hooks, assembly.sync, deadlines.floored(cfg.timeouts.match_s), traffic)
    _serve_diagnostics(inputs)
    return NodeServices(
        client=client,
        outer_client=outer_client,
        outer_traffic=traffic,
        checkpoints=checkpoints,
        snapshots=snapshot_writer,
        sync=assembly.sync,
        boundary=assembly.boundary,
        pipeline=assembly.pipeline,
        servicer=servicer,
    )


def _checkpoints(inputs: WiringInputs) -> Checkpointer | None:
    cfg, parts = inputs.config, inputs.parts
    if cfg.checkpoint.dir is None:
        return None
    return Checkpointer(
        Path(cfg.checkpoint.dir).expanduser(),
        cfg.checkpoint.every_steps,
        compute=parts.compute,
        stage=parts.stage,
        identity={"run_id": cfg.run.run_id, "manifest_hash": inputs.manifest_hash, "peer_id": inputs.me.peer_id},
        inner=parts.worker.inner,
        outer=parts.outer_state,
    )


def _snapshots(inputs: WiringInputs, outputs: SnapshotOutputs) -> Snapshots | None:
    if not outputs.every:
        return None
    name = f"stage{inputs.me.stage}-{inputs.me.peer_id[-8:]}"
    return Snapshots(outputs.folder, outputs.every, compute=inputs.parts.compute, stage=inputs.parts.stage, name=name)


def _serve_stage(inputs: WiringInputs, pipeline: PipelineParts, deadlines: LinkDeadlines) -> StageServicer:
    cfg = inputs.config
    max_bytes = cfg.pipeline.microbatch_size * cfg.model.seq_len * inputs.parts.shape.boundary_width * 4
    servicer = StageServicer(
        pipeline.runtime,
        run=ServedRun(cfg.run.run_id, inputs.manifest_hash),
        max_payload_bytes=max_bytes,
        receive_s=cfg.timeouts.receive_s,
        min_bytes_per_s=cfg.security.min_receive_bytes_per_s,
        screen=ValueScreen(cfg.security.payload_rms_factor, cfg.security.payload_max_abs),
        deadlines=deadlines,
        pinned_receive=inputs.parts.worker.device.type == "cuda",
    )
    inputs.server.add_stage(servicer)
    return servicer


def _serve_outer(
    inputs: WiringInputs, hooks: NodeHooks, sync: OuterSync, deadlines: LinkDeadlines, traffic: Traffic
) -> None:
    cfg = inputs.config
    inputs.server.add_outer(
        OuterServicer(
            sync.responder,
            peer_id=inputs.me.peer_id,
            run=ServedRun(cfg.run.run_id, inputs.manifest_hash, inputs.me.stage),
            max_bytes=sum(p.numel() * 16 for p in inputs.parts.stage.parameters()),
            deadlines=deadlines,
            traffic=traffic,
            faults=hooks.faults,
            donor=StageStateDonor(inputs.parts),
        )
    )


def _serve_diagnostics(inputs: WiringInputs) -> None:
    from noloco_node.rpc.diagnostics import DiagnosticsServicer

    cfg = inputs.config
    inputs.server.add_diagnostics(
        DiagnosticsServicer(
            run_id=cfg.run.run_id,
            version=__version__,
            manifest_hash=inputs.manifest_hash,
            timeout_s=cfg.timeouts.connect_s,
        )
    )
