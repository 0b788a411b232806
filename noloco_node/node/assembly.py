"""The composition root: a node's parts, each built by one constructor call from its own config
section, with every hook passed as a constructor argument.

    config -> model stage, inner optimizer, outer state -> StageWorker (compute thread)
           -> outer-sync method (sync/factory.py) -> inner-step boundary
           -> StageRuntime (+ Stage0Completions) -> Stage0Driver (stage 0)

`assemble` runs that sequence after the compute parts (sync -> boundary -> pipeline) from the ports
it is handed: `node/lifecycle.py` hands it gRPC and DHT adapters, `node/in_process.py` the
in-memory twins, so both run exactly this wiring. Both build their compute parts first with
`build_compute` (the real node sizes its all-reduce from them before its ports exist).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from noloco_node.config import NodeConfig
from noloco_node.node.boundary import InnerStepBoundary, Snapshots
from noloco_node.node.checkpoint import Checkpointer
from noloco_node.model.build import build_run_stage
from noloco_node.model.memory import check_fits
from noloco_node.model.stage import LlamaStage
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.completions import Stage0Completions
from noloco_node.pipeline.driver import DriverCounters, DriverSettings, Stage0Driver, overlapped
from noloco_node.pipeline.ports import Hop, ReplicaDirectory, StageTransport
from noloco_node.pipeline.router import Bans, Router
from noloco_node.pipeline.runtime import RuntimeHooks, RuntimeSettings, StageRuntime, StageShape
from noloco_node.pipeline.runtime_settings import StageNetwork
from noloco_node.pipeline.worker import StageWorker, WorkerSettings
from noloco_node.runtime.compute import ComputeThread, compute_device
from noloco_node.runtime.events import EventLog
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.memory import current_memory_bytes
from noloco_node.sync.factory import SyncPorts, build_outer_sync, method_traits
from noloco_node.sync.ports import OuterSync, SyncParts


@dataclass
class ComputeParts:
    """One stage's model, optimizers and compute thread: everything that touches tensors."""

    stage: LlamaStage
    device: torch.device
    worker: StageWorker
    compute: ComputeThread
    outer_state: OuterState | None
    shape: StageShape
    memory_estimate_bytes: int = 0
    """What model/memory.py estimates this stage needs to train (the start-up check)."""
    memory_baseline_bytes: int = 0
    """What the process held before the stage was built: its peak is reported above this."""


def build_compute(
    config: NodeConfig,
    llama,
    ranges: list[range],
    stage_index: int,
    *,
    vocab_size: int,
    events: EventLog,
    faults: FaultInjector,
) -> ComputeParts:
    """Build (and check the fit of) stage `stage_index` with its optimizers and worker."""
    traits = method_traits(config.outer.method)
    device = compute_device(config.pipeline.device)
    estimate = check_fits(config, llama, ranges, stage_index, device)  # before anything is allocated
    baseline = current_memory_bytes(device)
    # Drawn on the CPU (model/init.py) and materialised on the device: every device starts from the
    # same phi_0, and a GPU node never holds its stage in host RAM.
    stage = build_run_stage(config, llama, ranges, stage_index, device=device)
    optimizer = _inner_optimizer(config, stage)
    outer_state = None
    if traits.outer_rounds:  # slow weights phi and outer momentum m
        outer_state = OuterState(
            stage.named_parameters(), alpha=config.outer.alpha, beta=config.outer.beta, gamma=config.outer.gamma
        )
    # Stages > 0 step every batch worth of sequences, the step left due until the batch's last
    # gradient is on its way upstream; a method that takes the step (dp, after its all-reduce) does it itself.
    auto_step = stage_index != 0 and not traits.takes_inner_step
    worker = StageWorker(
        stage,
        optimizer,
        _worker_settings(config, stage, device, auto_step=auto_step),
        faults=faults,
        emit=events.emit,
        slow_weights=None if outer_state is None else (lambda: outer_state.phi),
    )
    return ComputeParts(
        stage,
        device,
        worker,
        ComputeThread(),
        outer_state,
        _stage_shape(config, stage, stage_index, vocab_size),
        memory_estimate_bytes=int(estimate.total),
        memory_baseline_bytes=baseline,
    )


def _inner_optimizer(config: NodeConfig, stage: LlamaStage) -> InnerOptimizer:
    inner = config.inner
    schedule = InnerSchedule(
        lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps, min_lr_ratio=inner.min_lr_ratio
    )
    return InnerOptimizer(
        stage.parameters(),
        schedule,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
        weight_decay=inner.weight_decay,
        clip_norm=inner.clip_norm,
    )


# Blockwise codecs a GPU stage encodes on its device. int4 gradients round stochastically from the
# transport's seeded generator, so they stay with the transport.
DEVICE_ACTIVATION_CODECS = ("int8", "fp8", "int4")
DEVICE_GRADIENT_CODECS = ("int8", "fp8")


def _device_codec(device: torch.device, codec: str, encodable: tuple[str, ...]) -> str | None:
    """The codec a GPU stage encodes one direction's results with on its device, if any."""
    return codec if device.type == "cuda" and codec in encodable else None


def _worker_settings(config: NodeConfig, stage: LlamaStage, device: torch.device, *, auto_step: bool) -> WorkerSettings:
    pipe = config.pipeline
    return WorkerSettings(
        batch_size=pipe.batch_size,
        saved_ttl_s=config.timeouts.saved_input_ttl_s,
        auto_step=auto_step,
        defer_step=auto_step,
        # Overlap: a step can fall between a microbatch's forward and its backward here.
        stash_weights=pipe.schedule == "overlap" and not stage.is_last,
        device=device,
        bf16_autocast=device.type == "cuda" and pipe.bf16_autocast,
        compute_delay_s=config.faults.compute_delay_s,
        # The runtime waits for results off the compute thread; on a CPU it runs the same path.
        results_later=device.type != "cuda" or pipe.overlap_result_copies,
        host_dtypes=tuple(
            torch.bfloat16 if device.type == "cuda" and codec == "bf16" else torch.float32
            for codec in (pipe.activation_codec, pipe.gradient_codec)
        ),
        # A GPU encodes its blockwise hops itself: activations round to nearest, gradients too
        # except int4's, whose stochastic rounding stays with the transport's seeded generator.
        device_codecs=(
            _device_codec(device, pipe.activation_codec, DEVICE_ACTIVATION_CODECS),
            _device_codec(device, pipe.gradient_codec, DEVICE_GRADIENT_CODECS),
        ),
    )


def _stage_shape(config: NodeConfig, stage: LlamaStage, stage_index: int, vocab_size: int) -> StageShape:
    """What the runtime checks every tensor crossing this stage's boundaries against."""
    return StageShape(
        stage=stage_index,
        num_stages=config.pipeline.num_stages,
        boundary_width=stage.boundary_width,
        seq_len=config.model.seq_len,
        microbatch_size=config.pipeline.microbatch_size,
        vocab_size=vocab_size,
        carries_token_ids=stage.subspace is not None,
    )


def build_sync(
    config: NodeConfig,
    parts: ComputeParts,
    ports: SyncPorts,
    *,
    peer_id: str,
    set_status: Callable[[str, int], Awaitable[None]],
    events: EventLog,
    faults: FaultInjector,
) -> OuterSync:
    worker = parts.worker
    sync_parts = SyncParts(
        compute=parts.compute,
        peer_id=peer_id,
        stage=parts.shape.stage,
        set_status=set_status,
        emit=events.emit,
        faults=faults,
        inner_steps=lambda: worker.inner_steps,
    )
    return build_outer_sync(config, sync_parts, ports, worker=parts.worker, state=parts.outer_state)


def runtime_settings(config: NodeConfig) -> RuntimeSettings:
    # The all-reduce baselines route balanced: every replica must get one batch per step so all
    # of a stage's replicas reach each round together.
    traits = method_traits(config.outer.method)
    routing = "balanced" if traits.balanced_routing else config.pipeline.routing
    return RuntimeSettings(
        max_in_flight=config.pipeline.max_in_flight,
        send_deadline_s=config.timeouts.rpc_s,
        routing=routing,
        routing_seed=config.run.seed,
        lockstep=traits.lockstep,
        lockstep_replicas=config.outer.allreduce_group_size if traits.lockstep else 0,
        delay_before_forward_s=config.faults.delay_before_forward_s,
    )


@dataclass
class PipelineParts:
    runtime: StageRuntime
    completions: Stage0Completions | None
    bans: Bans


def build_pipeline(
    config: NodeConfig,
    parts: ComputeParts,
    *,
    transport: StageTransport,
    directory: ReplicaDirectory,
    me: Hop,
    sync: OuterSync,
    on_inner_step: Callable[[int], Awaitable[None]],
    faults: FaultInjector,
) -> PipelineParts:
    """The stage's microbatch lifecycle. `on_inner_step` runs after each inner step the runtime
    takes (stages > 0); stage 0's driver calls the boundary itself."""
    completions = None
    if parts.shape.is_first:
        completions = Stage0Completions(gated=overlapped(driver_settings(config), parts.shape.is_last))
    hooks = RuntimeHooks(
        on_inner_step=None if parts.shape.is_first else on_inner_step,
        inner_step=sync.inner_step if sync.traits.takes_inner_step and not parts.shape.is_first else None,
        stage0=completions,
    )
    bans = Bans()
    router = Router(bans, random.Random(me.peer_id), by_capacity=config.pipeline.routing == "capacity")
    runtime = StageRuntime(
        shape=parts.shape,
        worker=parts.worker,
        compute=parts.compute,
        network=StageNetwork(transport=transport, directory=directory, router=router, me=me),
        settings=runtime_settings(config),
        hooks=hooks,
        faults=faults,
    )
    return PipelineParts(runtime, completions, bans)


def driver_settings(config: NodeConfig) -> DriverSettings:
    pipe = config.pipeline
    return DriverSettings(
        microbatch_size=pipe.microbatch_size,
        microbatch_timeout_s=config.timeouts.microbatch_s,
        sequential=pipe.deterministic,
        overlap=pipe.schedule == "overlap",
    )


def build_driver(
    config: NodeConfig,
    pipeline: PipelineParts,
    sync: OuterSync,
    batches: Iterator[tuple[Tensor, Tensor]],
    *,
    restored: dict | None = None,
    before_batch: Callable[[], Awaitable[None]] | None = None,
) -> Stage0Driver:
    return Stage0Driver(
        pipeline.runtime,
        batches,
        driver_settings(config),
        completions=pipeline.completions,
        inner_step=sync.inner_step if sync.traits.takes_inner_step else None,
        counters=DriverCounters.restored(restored) if restored else None,
        before_batch=before_batch,
    )


@dataclass(frozen=True)
class AssemblyPorts:
    """What a node talks through, as `assemble` needs it: gRPC and DHT adapters for a process
    node, the in-memory twins for the in-process swarm."""

    sync: SyncPorts
    transport: StageTransport
    directory: ReplicaDirectory
    me: Hop
    set_status: Callable[[str, int], Awaitable[None]]


@dataclass
class Assembly:
    sync: OuterSync
    boundary: InnerStepBoundary
    pipeline: PipelineParts


def assemble(
    config: NodeConfig,
    parts: ComputeParts,
    ports: AssemblyPorts,
    *,
    events: EventLog,
    faults: FaultInjector,
    checkpoints: Checkpointer | None = None,
    snapshots: Snapshots | None = None,
) -> Assembly:
    """The wiring every node shares, in the order each part needs the one before: the outer-sync
    method, the inner-step boundary, the stage's pipeline."""
    sync = build_sync(
        config, parts, ports.sync, peer_id=ports.me.peer_id, set_status=ports.set_status, events=events, faults=faults
    )
    boundary = InnerStepBoundary(
        worker=parts.worker,
        sync=sync,
        events=events,
        compute=parts.compute,
        stage_index=parts.shape.stage,
        bytes_sent=lambda: ports.transport.bytes_sent + sync.bytes_sent,
        checkpoints=checkpoints,
        snapshots=snapshots,
    )
    pipeline = build_pipeline(
        config,
        parts,
        transport=ports.transport,
        directory=ports.directory,
        me=ports.me,
        sync=sync,
        on_inner_step=boundary,
        faults=faults,
    )
    return Assembly(sync, boundary, pipeline)
