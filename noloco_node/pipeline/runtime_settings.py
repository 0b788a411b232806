"""What a StageRuntime (pipeline/runtime.py) is built from besides its compute: the stage's shape,
the settings of its admission and routing, the hooks where the rest of the node joins, and the
network it forwards on. Plain frozen values, so the node's assembly can build them from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from noloco_node.pipeline.completions import Stage0Completions
from noloco_node.pipeline.ports import Hop, ReplicaDirectory, StageTransport
from noloco_node.pipeline.router import Router


@dataclass(frozen=True, kw_only=True)
class StageShape:
    stage: int
    num_stages: int
    boundary_width: int
    """Values per token crossing a stage boundary: the hidden size, or the residual subspace's rank."""
    seq_len: int
    microbatch_size: int
    vocab_size: int
    carries_token_ids: bool = False
    """A residual-subspace model: the token ids travel with every forward (model/subspace.py)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    max_in_flight: int
    """Microbatches this stage holds at once; more are answered BUSY (the sender tries another)."""
    send_deadline_s: float
    """How long a forward keeps trying replicas of the next stage before the microbatch is dropped here."""
    routing: str = "random"
    """random | capacity | balanced | fixed (pipeline/router.py); balanced and fixed pick by sender index."""
    routing_seed: int = 0
    lockstep: bool = False
    """dp: a microbatch goes only to its balanced receiver, retried there until the deadline and
    never handed to another replica. A dp replica of a later stage steps per batch it received, so
    any other share leaves one replica short and the whole stage waiting for it in the all-reduce
    (seen in the convergence reproduction: three stage-1 replicas at step 12, one short, the
    stage-0 replicas waiting for the gradients those three hold until their round completes)."""
    lockstep_replicas: int = 0
    """In lockstep, the replicas every stage has (outer.allreduce_group_size; 0 = unknown). A view of
    the stages with fewer (records expired on a loaded machine) is not routed on: in it the balanced
    choice is another replica's, so the sender waits for the whole view instead."""
    delay_before_forward_s: float = 0.0
    """Fault injection (faults.delay_before_forward_s)."""


@dataclass(frozen=True)
class RuntimeHooks:
    """Where the rest of the node joins the microbatch lifecycle."""

    on_inner_step: Callable[[int], Awaitable[None]] | None = None
    """Spawned after each inner step this runtime's compute took (stages > 0; stage 0's driver
    steps itself): the outer-sync boundary, checkpoints, events."""
    inner_step: Callable[[], Awaitable[float]] | None = None
    """A method that takes the inner step itself (dp): awaited whenever a batch worth of sequences
    has been accumulated, instead of the worker's own step."""
    stage0: Stage0Completions | None = None
    """Stage 0: where completed microbatches are reported to the driver."""


@dataclass(frozen=True, kw_only=True)
class StageNetwork:
    """How the runtime reaches the other stages' replicas."""

    transport: StageTransport
    """Sends forwards and gradients, by peer."""
    directory: ReplicaDirectory
    """The live replicas of each stage."""
    router: Router
    """Picks the next stage's replica for a forward, and bans those that failed."""
    me: Hop
    """This node's own hop, appended to the route of every forward it sends."""
