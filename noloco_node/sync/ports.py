"""What replica synchronisation needs and offers, as plain types: no protobuf, no gRPC.

- `OuterSync` is the one interface every method implements (NoLoCo, DiLoCo, data-parallel, none).
  The training loop asks it at every inner-step boundary (torchft's shape): its `traits` say
  whether the method takes the inner step itself (dp averages gradients first), and `at_boundary`
  is awaited after every inner step; the method decides whether an outer round runs, and whether
  it blocks training while it does.
- `MethodTraits` is what the rest of the node needs to know about a method (routing, who steps,
  state donation, moving stages, the all-reduce's shapes), so nothing outside sync/ names one;
  sync/factory.py gives them for a config's method before the sync object is built.
- `AllReduce` averages tensors over a group of replicas (dht/averaging.py over hivemind,
  sync/memory.py in memory); DiLoCo and dp run on it.
- `PairingTransport` carries one pairwise exchange and a state fetch to a peer; `PairingResponder`
  is what the transport's server side asks when a peer proposes. rpc/outer_service.py implements
  both over gRPC; sync/memory.py implements them in memory for the fast tests.
- `MatchingDirectory` lists the replicas of a stage that are matching a round.

The snapshot data model (`EncodedSnapshot`, `ExpectedTensor`) lives here so the transport and
the sync layer share it without either importing the other.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from noloco_node.errors import InvalidPayload
from noloco_node.pipeline.ports import Peer
from noloco_node.runtime.compute import ComputeThread
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.node_stats import OuterCounts, OuterStats
from noloco_node.codec.tensors import TensorSpec

if TYPE_CHECKING:
    from noloco_node.pipeline.worker import StageWorker


@dataclass(frozen=True)
class EncodedSnapshot:
    """A frozen snapshot as it goes on the wire: (name, spec, payload) per tensor, in order."""

    tensors: list[tuple[str, TensorSpec, bytes]]

    @property
    def sha256(self) -> bytes:
        digest = hashlib.sha256()
        for _, _, payload in self.tensors:
            digest.update(payload)
        return digest.digest()

    @property
    def payload_bytes(self) -> int:
        return sum(len(p) for _, _, p in self.tensors)


@dataclass(frozen=True)
class ExpectedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    codec: str = ""
    """Wire codec this tensor must use; empty = the exchange's codec (phi and Delta may differ)."""
    nnz: int | None = None
    """Sparse codecs: the exact count the receiver's own config implies (top-k's kept values, per
    chunk for topk_int2/4); a larger one is an oversized payload. None = not checked."""
    slice_key: tuple[int, int, int] | None = None
    """slice: the (seed, parts, part) this round's slice must have."""

    def problem(self, name: str, spec, codec: str) -> str | None:
        """Why the tensor a partner declares (`name`, its TensorSpec) is not this one, or None;
        `codec` is the exchange's when this tensor names none of its own."""
        want_codec = self.codec or codec
        if name != self.name or spec.shape != self.shape or spec.dtype != self.dtype or spec.codec != want_codec:
            return (
                f"tensor {name!r} {spec.dtype}{list(spec.shape)}/{spec.codec} does not match "
                f"{self.name!r} {self.dtype}{list(self.shape)}/{want_codec}"
            )
        if self.nnz is not None and spec.nnz != self.nnz:
            return f"tensor {name!r} declares {spec.nnz} sparse values where this run's codec sends {self.nnz}"
        if self.slice_key is not None and (spec.slice_seed, spec.slice_parts, spec.slice_part) != self.slice_key:
            return (
                f"tensor {name!r} is slice {spec.slice_part}/{spec.slice_parts} of seed {spec.slice_seed}; "
                f"this round's is {self.slice_key[2]}/{self.slice_key[1]} of seed {self.slice_key[0]}"
            )
        return None

    def check(self, name: str, spec, codec: str) -> None:
        """Raises InvalidPayload for the `problem` with a declared tensor: a receiver refuses it
        before allocating anything for it."""
        problem = self.problem(name, spec, codec)
        if problem is not None:
            raise InvalidPayload(problem)


def check_tensor_count(count: int, expected: list[ExpectedTensor]) -> None:
    """Raises InvalidPayload when a snapshot declares another number of tensors than `expected`."""
    if count != len(expected):
        raise InvalidPayload(f"snapshot has {count} tensors, expected {len(expected)}")


@dataclass(frozen=True)
class PairProposal:
    """An initiator's request to pair for one round."""

    peer_id: str
    stage: int
    round: int
    inner_step: int
    nonce: bytes
    sends_slow_weights: bool
    """The phi+Delta form (True) or theta alone; both sides must send the same form."""


class Decision(enum.Enum):
    ACCEPT = "accept"
    BUSY = "busy"  # paired already, not matching, banned, own proposal pending
    WAIT = "wait"  # the responder has not reached that round yet
    MISMATCH = "mismatch"  # snapshot forms (gamma, codecs) differ: never pairable


@dataclass(frozen=True)
class PairAnswer:
    decision: Decision
    reason: str = ""
    wait_s: float = 0.0


@dataclass
class OuterCounters:
    rounds: int = 0
    paired: int = 0
    solo: int = 0
    rejected: int = 0
    timed_out: int = 0
    skipped: int = 0  # dp: rounds every replica skipped together (the all-reduce failed)
    resynced: int = 0  # dp: rounds that found replicas apart and averaged their states back together
    mixed_rounds: int = 0  # diloco/dp: all-reduce groups that spanned rounds
    partial_rounds: int = 0  # diloco/dp: all-reduces that delivered part of the mean only
    # one entry per round: round, outcome, partner, seconds, payload ("theta" or "phi+delta"),
    # bytes per tensor kind, delta_rel_error (and phi_rel_error), codecs
    history: list[dict] = field(default_factory=list)

    def snapshot(self) -> OuterCounts:
        """The counters now, without the history."""
        return OuterCounts(**{name: value for name, value in vars(self).items() if name != "history"})


@dataclass(frozen=True)
class SyncParts:
    """What every method shares with its node: the compute thread its math runs on, who it is, how
    it tells the swarm its status (the node's DHT record) and its event stream."""

    compute: ComputeThread
    peer_id: str
    stage: int
    set_status: Callable[[str, int], Awaitable[None]]
    """(status, outer round) -> announced: `matching` while a round looks for a partner."""
    emit: Callable[..., Any] = lambda event, **fields: None
    faults: FaultInjector | None = None
    inner_steps: Callable[[], int] = lambda: 0
    """This replica's inner-step counter (rounds record the step their update was applied at)."""


class PairingResponder(Protocol):
    """What the transport's server side needs from the sync layer."""

    def decide(self, proposal: PairProposal) -> PairAnswer:
        """Accept (and reserve this round for) or refuse a proposal; never blocks."""

    def frozen(self) -> tuple[EncodedSnapshot, list[ExpectedTensor], str]:
        """The snapshot to send, the tensors expected back, and the codec they must use."""

    def screen(self, received: dict[str, Tensor]) -> None:
        """Judge the partner's decoded snapshot before our receipt goes out; raises PoisonedPayload
        for non-finite values, InvalidPayload for one beyond the distance bound."""

    async def finish(self, peer_id: str, received: dict[str, Tensor] | None, reason: str) -> None:
        """Called once per accepted session: with the partner's tensors, or None on failure."""


class StateDonor(Protocol):
    async def export_state(self) -> tuple[dict[str, Tensor], str]:
        """A consistent copy of this replica's state (named tensors) and its counters as JSON."""


class PairingTransport(Protocol):
    bytes_sent: int
    """Outer payload bytes this node has written (as initiator and as responder)."""
    bytes_received: int
    """Outer payload bytes this node has read (as initiator and as responder)."""

    async def exchange(
        self,
        peer_id: str,
        proposal: PairProposal,
        mine: EncodedSnapshot,
        expected: list[ExpectedTensor],
        codec: str,
        *,
        timeout_s: float,
        screen: Callable[[dict[str, Tensor]], None] | None = None,
    ) -> dict[str, Tensor]:
        """Propose and, if accepted, swap snapshots; returns the partner's decoded tensors.
        Raises PeerBusy (refused), ProtocolMismatch, InvalidPayload or PeerUnavailable."""

    def exchange_deadline_s(self, peer_id: str, payload_bytes: int) -> float:
        """The longest an accepted exchange moving `payload_bytes` (both ways) with the peer may run."""

    async def fetch_state(
        self,
        peer_id: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> tuple[dict[str, Tensor], dict]:
        """A donor's state tensors (checked against `expected`) and counters."""

    async def close(self) -> None: ...


class MatchingDirectory(Protocol):
    async def matching(self, stage: int, round_index: int) -> list[Peer]:
        """Replicas of `stage` that announce `matching` for `round_index` (fresh lookup)."""

    async def replica_count(self, stage: int) -> int:
        """Live replicas of `stage`, ours included (the gather window ends once all match)."""


class StageProgress(Protocol):
    async def inner_steps(self, stage: int, *, timeout_s: float) -> dict[str, int]:
        """Each live replica of `stage` (by peer id) and the inner step it last announced (fresh
        lookup): how a replica learns the others have moved past a round it is still trying."""


class AllReduce(Protocol):
    bytes_sent: int

    async def mean(
        self, tensors: list[Tensor], timeout_s: float, round_index: int
    ) -> tuple[list[Tensor], int, bool, bool]:
        """Group mean, group size (1 = nobody joined), whether all members were at this round, and
        whether the whole mean arrived (else some parts are our own values)."""

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class MethodTraits:
    """What an outer-sync method means for the rest of the node. Each OuterSync class carries its
    own (`OuterSync.traits`); `sync.factory.method_traits` gives them for a config's method before
    anything is built (the all-reduce and whether the node may move are needed first)."""

    name: str
    """outer.method, as data: events, summaries and the notes a person reads name it."""
    syncs: bool = False
    """Replicas synchronise at all: the method keeps counters, a round history and outer bytes."""
    outer_rounds: bool = False
    """Outer rounds every outer.inner_steps_per_outer inner steps on slow weights phi: the node
    keeps an OuterState, announces its round, and a round can go solo."""
    takes_inner_step: bool = False
    """The method takes the inner step itself (`OuterSync.inner_step`, after averaging the
    gradients), instead of the worker (stages > 0) or the stage-0 driver."""
    lockstep: bool = False
    """Every replica of a stage steps together each inner step: the pipeline routes in lockstep
    (the same receiver again on a retry) over outer.allreduce_group_size replicas."""
    balanced_routing: bool = False
    """Every replica must get one batch per step so all of a stage's replicas reach each round
    together: routing is balanced whatever pipeline.routing says."""
    all_reduce_shapes: Callable[[StageWorker], list[torch.Size]] | None = None
    """The tensors one all-reduce round averages, for a stage's worker; None = no all-reduce."""
    donates_state: bool = False
    """Replicas answer pairing proposals and FetchState: a fresh node copies a live replica's state."""
    movable: bool = False
    """A replica may move to another stage (it needs a donor there; an all-reduce group's size is fixed)."""

    @property
    def all_reduce(self) -> bool:
        return self.all_reduce_shapes is not None


NO_SYNC = MethodTraits("none")


class OuterSync(ABC):
    """One replica's synchronisation with the other replicas of its stage."""

    traits: MethodTraits = NO_SYNC

    def __init__(self) -> None:
        self.counters = OuterCounters()
        self._running: set[asyncio.Task] = set()

    @property
    def method(self) -> str:
        return self.traits.name

    async def inner_step(self) -> float:
        """The inner step, for methods that take it (dp); returns the learning rate used."""
        raise NotImplementedError(f"{self.method} does not take the inner step")

    def start_at(self, round_index: int) -> None:
        """Carry on from `round_index` (a resumed checkpoint's or a donor's round); methods that
        count their rounds elsewhere ignore it."""

    def wind_down(self) -> None:
        """The node is stopping: a running round stops waiting for latecomers (it still ends
        within its own deadlines). Methods that never wait past them ignore it."""

    def may_skip_round(self, inner_step: int) -> bool:
        """Whether the round due after `inner_step` may be left out when a later round is already
        due (a replica whose boundaries queued behind a long round). Methods whose rounds a whole
        group takes together (an all-reduce) never leave one out."""
        return False

    @abstractmethod
    async def at_boundary(self, inner_step: int) -> None:
        """After inner step `inner_step`: run an outer round if one is due (it may finish later).
        The node calls it once per inner step, in step order, one call at a time."""

    @property
    def outer_round(self) -> int:
        """The round this replica is at (announced in its record)."""
        return 0

    @property
    def bytes_sent(self) -> int:
        return 0

    @property
    def bytes_received(self) -> int:
        return 0

    def stats_view(self) -> OuterStats:
        """Its round counters, rounds and outer bytes sent and received, as the node's stats report them."""
        return OuterStats(
            counts=self.counters.snapshot(),
            history=list(self.counters.history),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )

    @property
    def responder(self) -> PairingResponder | None:
        """The responder a transport's server hands pairing proposals to, if the method pairs."""
        return None

    def round_bound_s(self) -> float:
        """How long the round under way may still take by the method's own deadlines (0: none, or
        the method has no bound of its own and the caller's timeout applies)."""
        return 0.0

    async def settle(self, timeout_s: float) -> bool:
        """Wait until no round is running (the weights are post-update); False on timeout. A round
        that starts while we wait (a later stage still stepping on the gradients in flight) is
        waited for too: waiting only for the rounds running at the call left that one cut short."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._running:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await asyncio.wait(set(self._running), timeout=left)
        return True

    async def close(self) -> None:
        """Release what the method holds (transports, averager processes)."""

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task


class NoSync(OuterSync):
    """outer.method = none: every replica trains alone."""

    async def at_boundary(self, inner_step: int) -> None:
        return None
