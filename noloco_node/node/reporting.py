"""What `join` says about training in its log, for nodes without a terminal (systemd, Docker):
a step line every `log.every_steps` inner steps and one closing summary line.

Formatting is pure (a `Snapshot` of plain numbers in, one line out) so it is tested without a
node; node/stats.py's `training_snapshot` gathers the numbers from the node's typed stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from noloco_node.runtime.node_stats import RoundBytes

log = logging.getLogger("noloco_node.training")


@dataclass(frozen=True)
class Snapshot:
    stage: int
    step: int  # this stage's inner steps
    tokens: int  # tokens this stage processed
    lr: float | None
    loss: float | None = None  # stage 0: mean loss of the latest inner step; other stages have none
    first_loss: float | None = None
    in_flight: int = 0
    served: int = 0  # stages > 0: forwards received from upstream
    outer: dict | None = None  # counters (rounds, paired, solo, rejected); None = no outer method
    last_round: dict | None = None  # the latest outer round: {"round", "outcome", ...}
    bytes_sent: int = 0  # pipeline and outer payloads
    bytes_received: int = 0  # pipeline and outer payloads
    dropped: int = 0  # stage 0: microbatches given up; other stages: forwards dropped here
    issued: int | None = None  # stage 0: distinct microbatches issued
    attention: tuple[str, ...] = ()  # what needs attention (node/attention.py)
    round_bytes: RoundBytes | None = None  # an outer snapshot's bytes: last, mean and share of fp32 phi + Delta


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _steps(snap: Snapshot, total: int | None) -> str:
    return f"{snap.step}/{total}" if total else str(snap.step)


def _lr(lr: float | None) -> str:
    return f"lr {lr:.1e}" if lr is not None else "lr -"


def _outer(snap: Snapshot) -> str:
    if snap.outer is None:
        return "outer off"
    if snap.last_round is None:
        return "outer no round yet"
    return f"outer {snap.last_round.get('outcome', '?')} (round {snap.last_round.get('round', '?')})"


def _bytes(snap: Snapshot, *, say_what: bool = False) -> str:
    if not say_what:
        return f"sent {format_bytes(snap.bytes_sent)} recv {format_bytes(snap.bytes_received)}"
    # Said in the summary: a researcher's audit read `recv 0 B` after eight paired rounds (outer bytes
    # received were not counted then) as nothing received.
    what = "(pipeline + outer)" if snap.outer is not None else "(pipeline)"
    return f"sent {format_bytes(snap.bytes_sent)} {what} recv {format_bytes(snap.bytes_received)} {what}"


def step_line(snap: Snapshot, *, total: int | None, tokens_per_s: float) -> str:
    """E.g. `step 40/200 | loss 5.123 | lr 3.0e-04 | 812 tok/s | in flight 3 | outer paired (round 4) |
    sent 1.2 MB recv 1.1 MB`; stages > 0 show `served N microbatches` (received) where stage 0 shows
    its loss."""
    if snap.stage == 0:
        own = f"loss {snap.loss:.3f}" if snap.loss is not None else "loss -"
    else:
        own = f"served {snap.served} microbatches"
    return " | ".join(
        [
            f"step {_steps(snap, total)}",
            own,
            _lr(snap.lr),
            f"{tokens_per_s:.0f} tok/s",
            f"in flight {snap.in_flight}",
            _outer(snap),
            _bytes(snap),
        ]
    )


def summary_line(
    snap: Snapshot,
    *,
    total: int | None,
    wall_s: float,
    tokens_per_s: float | None = None,
    waited_s: float | None = None,
    session_steps: int | None = None,
    moved_s_before_end: float | None = None,
) -> str:
    """E.g. `summary: stage 0 | 200/200 steps | 61.2 s (first step after 3.1 s) | 812 tok/s mean while
    training | loss 8.301 -> 5.012 | outer 5 rounds: 4 paired, 1 solo, 0 rejected | sent 12.0 MB (pipeline +
    outer) recv 11.5 MB (pipeline + outer) | dropped 0 of 800 microbatches`. The mean rate is `tokens_per_s` (from
    the first step on) when given, else over the whole wall time. `session_steps`, when it differs
    from the node's step count (it resumed a checkpoint or copied a replica's state), is added as
    `(N this session)`; a node that moved between stages says its counters start at the move."""
    if tokens_per_s is not None:
        rate = f"{tokens_per_s:.0f} tok/s mean while training"
    else:
        rate = f"{snap.tokens / max(wall_s, 1e-6):.0f} tok/s mean"
    parts = [
        f"summary: stage {snap.stage}",
        f"{_steps(snap, total)} steps"
        + (f" ({session_steps} this session)" if session_steps is not None and session_steps != snap.step else ""),
        f"{wall_s:.1f} s" + (f" (first step after {waited_s:.1f} s)" if waited_s is not None else ""),
        rate,
    ]
    if snap.stage == 0:
        parts.append(f"loss {snap.first_loss:.3f} -> {snap.loss:.3f}" if snap.loss is not None else "loss -")
    else:
        parts.append(f"served {snap.served} microbatches")
    if snap.outer is None:
        parts.append("outer off")
    else:
        o = snap.outer
        parts.append(
            f"outer {o.get('rounds', 0)} rounds: {o.get('paired', 0)} paired, {o.get('solo', 0)} solo, "
            f"{o.get('rejected', 0)} rejected"
        )
        if snap.round_bytes is not None and snap.round_bytes.mean:
            parts.append(
                f"{format_bytes(snap.round_bytes.mean)} per round "
                f"({snap.round_bytes.fp32_fraction:.2%} of fp32 phi + Delta)"
            )
    parts.append(_bytes(snap, say_what=True))
    parts.append(
        f"dropped {snap.dropped} of {snap.issued} microbatches"
        if snap.issued is not None
        else f"dropped {snap.dropped} microbatches"
    )
    if moved_s_before_end is not None:
        parts.append(f"rounds, bytes and microbatches since its move {moved_s_before_end:.0f} s before the end")
    parts.extend(f"warning: {note}" for note in snap.attention)
    return " | ".join(parts)


class TrainingLog:
    """Logs a step line when a multiple of `every_steps` is reached or passed (stages > 0 are polled,
    so they may see step 41 first) and the summary once; tokens/s on a step line is the rate since
    the previous line (the first: since serving)."""

    def __init__(self, every_steps: int, total: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps, self.total, self.clock = every_steps, total, clock
        self.started = self._mark = clock()
        self._mark_tokens = 0
        self._next = every_steps
        self._first: tuple[float, int] | None = None  # (when, tokens) at the first tokens seen
        self._latest: tuple[float, int] | None = None  # (when, tokens) when the tokens last grew
        self._from_step: int | None = None  # the step count this node (since its last move) began at
        self._last_step, self._trained_before, self._moved_at = 0, 0, None
        self.summarized = False

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step >= self._next

    def step(self, snap: Snapshot) -> str | None:
        if not self.due(snap.step):
            return None
        now = self.clock()
        rate = (snap.tokens - self._mark_tokens) / max(now - self._mark, 1e-6)
        self._mark, self._mark_tokens = now, snap.tokens
        self._next = (snap.step // self.every_steps + 1) * self.every_steps
        line = step_line(snap, total=self.total, tokens_per_s=rate)
        log.info("%s", line)
        return line

    def observe(self, tokens: int, step: int) -> None:
        """Called as the node goes: marks when its first tokens were done, so the summary's mean rate
        counts training, not the wait for the swarm before it (a researcher's audit read a mean 2-3x
        low on short runs), and the step it began at, so a resumed node does not count its
        checkpoint's steps as this session's (a NAT audit read '340 steps' of a node that trained none)."""
        if self._first is None and tokens > 0:
            self._first = (self.clock(), tokens)
        if tokens > 0 and (self._latest is None or tokens > self._latest[1]):
            self._latest = (self.clock(), tokens)  # the rate ends here: not the idle serving after the last step
        if self._from_step is None:
            self._from_step = step
        self._last_step = step

    def moved(self, total: int | None) -> None:
        """The node moved (a stage change, or a copy of its stage's state): a new node with its own
        counters and step count, and `total` steps to train (None off stage 0). The summary still
        covers the whole session."""
        self.total = total
        if self._from_step is not None:
            self._trained_before += self._last_step - self._from_step
        self._from_step, self._first, self._latest, self._moved_at = None, None, None, self.clock()

    def _session_steps(self, step: int) -> int:
        return self._trained_before + (step - self._from_step if self._from_step is not None else 0)

    def summary(self, snap: Snapshot) -> str | None:
        if self.summarized:
            return None
        self.summarized = True
        now = self.clock()
        rate = None
        end = self._latest if self._latest is not None and self._latest[1] >= snap.tokens else (now, snap.tokens)
        if self._first is not None and end[0] - self._first[0] > 0 and end[1] > self._first[1]:
            rate = (end[1] - self._first[1]) / (end[0] - self._first[0])
        line = summary_line(
            snap,
            total=self.total,
            wall_s=now - self.started,
            tokens_per_s=rate,
            waited_s=None if self._first is None or self._moved_at is not None else self._first[0] - self.started,
            session_steps=None
            if self._from_step is None and self._moved_at is None
            else self._session_steps(snap.step),
            moved_s_before_end=None if self._moved_at is None else now - self._moved_at,
        )
        log.log(logging.WARNING if snap.attention else logging.INFO, "%s", line)
        return line
