"""A node's stats as typed values. Pure data, no torch: every layer may build its part of them.

Each part of a node reports its own numbers as one of the frozen dataclasses below (the stage-0
driver, the admission pieces, the links, the outer sync); node/stats.py composes them, with the
stage's work counters, into one `NodeStats`, and the in-process readers (/metrics, join's step
lines and summary, the node page) read its fields. `NodeStats.to_dict()` is the stats file
(`{out}/nodes/*.json`), a file format experiments and tests read: its keys and nesting stay as
they are whatever the fields here are called (tests/unit/node/test_node_stats.py pins them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkStats:
    """What the node's stage computed, sent, received and routed."""

    inner_steps: int
    last_lr: float
    """The worker's latest learning rate; 0.0 before its first step."""
    sequences: int
    tokens: int
    """Tokens this stage computed backward for."""
    forwards_received: dict[str, int]
    """Upstream peer id -> forwards received from it."""
    forwards_sent: int
    backwards_sent: int
    send_failures: int
    dropped_here: int
    """Forwards this stage dropped (not computed or not passed on)."""
    expired: int
    busy_answers: int
    """Forwards refused because the in-flight window was full."""
    routed_balanced: int
    """Forwards sent to the balanced (permutation) or fixed choice."""
    routed_random: int
    """Forwards sent to a random choice (random routing, fallback or retry)."""
    routed_to: dict[str, int]
    """Next-stage peer id -> forwards it accepted."""
    routed_by_capacity: dict[str, int]
    """Next-stage peer id -> picks weighted by its measured capacity."""
    routed_expected: dict[str, float]
    """Next-stage peer id -> the share of picks its capacity called for."""
    throughput: dict[str, float]
    """The meter's capacity, throughput, busy, hop_s and link_mbit_s (runtime/throughput.py)."""
    bytes_sent: int
    """Pipeline payload bytes sent (the outer sync's are `OuterStats.bytes_sent`)."""
    rejected: dict[str, int]
    """Status code (or `poisoned`) -> calls the stage servicer rejected."""
    saved_inputs: int
    """Forward inputs held for their backward."""
    bans: int
    """Next-stage peers banned after failed calls, in total."""
    in_flight: int
    bytes_received: int

    @property
    def served(self) -> int:
        """Forwards received from upstream, from all peers."""
        return sum(self.forwards_received.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        balanced, random = out.pop("routed_balanced"), out.pop("routed_random")
        # The file nests the two routing counts; the keys after them keep their place.
        ordered = {}
        for key, value in out.items():
            ordered[key] = value
            if key == "busy_answers":
                ordered["routed"] = {"balanced": balanced, "random": random}
        return ordered


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionStats:
    """Calls refused before any servicer ran, and the peer guard's bans and limits."""

    swarm_key: bool
    """Whether the node admits only holders of a swarm key."""
    refused: dict[str, int]
    """Status code -> calls the admission interceptor refused."""
    peers_banned: int
    """Bans given for repeated invalid messages, in total."""
    banned_now: int
    rate_limited: int
    over_stream_cap: int
    refused_banned: int
    """Calls refused because their peer was under a ban."""
    tracked_peers: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStats:
    """How peers reach the node and the bytes per path (transport/links.py)."""

    reach: str
    """direct, holepunched or relayed."""
    p2p_addrs: list[str]
    bytes_by_path: dict[str, dict[str, int]]
    """Path -> direction (in, out) -> bytes."""
    replayed_tokens: int
    """Calls refused as replays of a used token."""
    streams_in: int
    streams_out: int
    streams_refused_in: int
    relay_served: dict[str, Any] | None
    """What this node relayed for peers behind NAT; None when it serves no relay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportStats:
    """The links' numbers, and the impostors and cut streams the layers above them saw."""

    links: LinkStats
    impostor_records: int
    """DHT records refused: they claimed another node's peer id."""
    impostor_calls: int
    """Bridged calls whose token named another peer than libp2p proved."""
    cut_at_receive_deadline: int

    def to_dict(self) -> dict[str, Any]:
        links = self.links
        return {
            "reach": links.reach,
            "p2p_addrs": list(links.p2p_addrs),
            "bytes_by_path": {path: dict(d) for path, d in links.bytes_by_path.items()},
            "impostor_records": self.impostor_records,
            "impostor_calls": self.impostor_calls,
            "replayed_tokens": links.replayed_tokens,
            "cut_at_receive_deadline": self.cut_at_receive_deadline,
            "libp2p_streams": {
                "in": links.streams_in,
                "out": links.streams_out,
                "refused_in": links.streams_refused_in,
            },
            "relay_served": links.relay_served,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class IntegrityStats:
    """Steps skipped, weights repaired and payloads refused for not being finite."""

    skipped_steps: int
    weights_repaired: int
    dropped_non_finite: int
    payloads_refused: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterCounts:
    """The outer sync's round counters (sync/ports.py's OuterCounters, without the history)."""

    rounds: int
    paired: int
    solo: int
    rejected: int
    timed_out: int
    skipped: int
    """dp: rounds every replica skipped together (the all-reduce failed)."""
    resynced: int
    """dp: rounds that found replicas apart and averaged them back together."""
    mixed_rounds: int
    """diloco/dp: all-reduce groups that spanned rounds."""
    partial_rounds: int
    """diloco/dp: all-reduces that delivered part of the mean only."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundBytes:
    """An outer snapshot's payload bytes (one way): the last round's, the mean, and the mean share
    of fp32 phi + Delta they were."""

    last: int
    mean: float
    fp32_fraction: float

    @classmethod
    def of(cls, history: list[dict]) -> RoundBytes:
        sizes = [sum(h["bytes"].values()) for h in history if isinstance(h.get("bytes"), dict)]
        fractions = [h["fp32_fraction"] for h in history if "fp32_fraction" in h]
        return cls(
            last=int(sizes[-1]) if sizes else 0,
            mean=sum(sizes) / len(sizes) if sizes else 0.0,
            fp32_fraction=sum(fractions) / len(fractions) if fractions else 0.0,
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @staticmethod
    def last_of(history: Sequence[dict]) -> int:
        """The last round's payload bytes, read from the end (what the record carries each
        heartbeat: `of` went over the whole history, thousands of rounds in a long run)."""
        for entry in reversed(history):
            if isinstance(entry.get("bytes"), dict):
                return int(sum(entry["bytes"].values()))
        return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterStats:
    """The outer sync's counters, its rounds and the bytes it sent and received."""

    counts: OuterCounts
    history: list[dict]
    """One entry per round: round, outcome, partner, seconds, payload, bytes per tensor kind, ..."""
    bytes_sent: int
    bytes_received: int = 0

    @property
    def last_round(self) -> dict | None:
        return self.history[-1] if self.history else None

    @property
    def bytes_per_round(self) -> RoundBytes:
        return RoundBytes.of(self.history)

    def to_dict(self) -> dict[str, Any]:
        """The stats file's outer keys (they sit at its top level)."""
        return {
            "outer": self.counts.to_dict(),
            "outer_history": self.history,
            "bytes_sent_outer": self.bytes_sent,
            "bytes_received_outer": self.bytes_received,
            "outer_bytes_per_round": self.bytes_per_round.to_dict(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchCounts:
    """The stage-0 driver's microbatches: issued == completed + dropped once training stops."""

    issued: int
    completed: int
    reissued: int
    """Extra attempts of microbatches already issued."""
    dropped: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverStats:
    """The stage-0 driver's microbatches, losses and schedule (pipeline/driver.py)."""

    microbatches: MicrobatchCounts
    losses: list[float]
    """Per completed microbatch, in completion order."""
    lrs: list[float]
    step_times: list[float]
    step_losses: list[float]
    """Mean loss over each inner step's completed microbatches."""
    logged_step: int | None
    """The inner step `step_losses[-1]` belongs to (None before the first); a step line reports
    this step, not the worker's count, which moves on before the driver logs the step's loss."""
    reissued_sequences: list[int]
    overlap: bool
    """Whether batch k+1's forwards start before step k (pipeline.schedule = overlap)."""
    stale_microbatches: int
    """Completed with an inner step between their forward and backward."""
    max_staleness: int

    def to_dict(self) -> dict[str, Any]:
        """The stats file's driver keys (they sit at its top level)."""
        return {
            "microbatches": self.microbatches.to_dict(),
            "losses": self.losses,
            "lrs": self.lrs,
            "step_times": self.step_times,
            "step_losses": self.step_losses,
            "reissued_sequences": self.reissued_sequences,
            "schedule": {
                "overlap": self.overlap,
                "stale_microbatches": self.stale_microbatches,
                "max_staleness": self.max_staleness,
            },
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStats:
    """Everything a node reports about itself, read from its parts at one moment."""

    peer_id: str
    stage: int
    address: str
    work: WorkStats
    tokens_per_s: float
    """Tokens this stage processed per second since it started."""
    attention: list[str]
    """What needs a person's attention now (node/attention.py)."""
    admission: AdmissionStats
    transport: TransportStats
    integrity: IntegrityStats
    routing_bans: list[str]
    """Every next-stage peer banned at least once."""
    faults_fired: list[str]
    """`point:action` of each injected fault that fired."""
    outer: OuterStats | None = None
    """None when the method does not sync (outer.method = none)."""
    outer_round: int | None = None
    """The round the node is at; None when its method takes no rounds (then no `fetched_state`)."""
    fetched_state: dict | None = None
    """What a joiner copied from a donor (None: nothing)."""
    resumed_from: dict | None = None
    """The checkpoint the node resumed from (None: it started fresh)."""
    movable: bool = False
    moves: list[dict]
    """Each: from, to, at, inner_step, and the stage-0 driver's microbatches before it."""
    driver: DriverStats | None = None
    """Stage 0's driver; None on other stages."""
    inherited_microbatches: dict[str, int] | None = None
    """Stage 0 restarted at its last step, with nothing left to train: its predecessor's counts."""

    @property
    def loss(self) -> float | None:
        """Stage 0's last microbatch loss."""
        return self.driver.losses[-1] if self.driver is not None and self.driver.losses else None

    @property
    def microbatches_completed(self) -> int:
        if self.driver is not None:
            return self.driver.microbatches.completed
        return int((self.inherited_microbatches or {}).get("completed", 0))

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent: pipeline and outer sync."""
        return self.work.bytes_sent + (self.outer.bytes_sent if self.outer is not None else 0)

    @property
    def bytes_received(self) -> int:
        """Payload bytes received: pipeline and outer sync."""
        return self.work.bytes_received + (self.outer.bytes_received if self.outer is not None else 0)

    def to_dict(self) -> dict[str, Any]:
        """The stats file: the same keys, nesting and values whatever the fields here are called."""
        out: dict[str, Any] = {"peer_id": self.peer_id, "stage": self.stage, "address": self.address}
        out.update(self.work.to_dict())
        out["tokens_per_s"] = self.tokens_per_s
        out["attention"] = list(self.attention)
        out["admission"] = self.admission.to_dict()
        out["transport"] = self.transport.to_dict()
        out["integrity"] = self.integrity.to_dict()
        out["routing_bans"] = list(self.routing_bans)
        out["faults_fired"] = list(self.faults_fired)
        if self.outer is not None:
            out.update(self.outer.to_dict())
        if self.outer_round is not None:
            out["outer_round"] = self.outer_round
            out["fetched_state"] = self.fetched_state
        out["resumed_from"] = self.resumed_from
        out["movable"] = self.movable
        out["moves"] = self.moves
        if self.driver is not None:
            out.update(self.driver.to_dict())
        elif self.inherited_microbatches is not None:
            out["microbatches"] = dict(self.inherited_microbatches)
        return out
