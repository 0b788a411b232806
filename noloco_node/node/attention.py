"""What a running node should tell a person without being asked: what it waits for when it is not
computing, and what needs attention (outer rounds that keep going solo, no replica to pair with, no
progress for a long while), each with its likely cause and the fix.

Pure: plain numbers in, sentences out, so the rules are tested without a node. The progress line,
the step lines and summary (cli/join.py), the node's DHT record (so `noloco-node status` shows it)
and the demo's closing report all read these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from noloco_node.runtime.node_status import Status

SOLO_WINDOW = 4
"""The latest outer rounds looked at: all of them solo is a warning (one solo round is normal)."""
STALL_S = 120.0
"""No inner step for this long, while the node is not knowingly waiting, is a warning."""
MAX_NOTES = 4
MAX_NOTE_CHARS = 200  # what a DHT record carries of each note (dht/records.py)


@dataclass(frozen=True)
class NodeView:
    stage: int
    rounds_go_solo: bool
    """the method's outer rounds can go solo (sync.ports.MethodTraits.outer_rounds: NoLoCo, DiLoCo)"""
    all_reduce: bool
    """its rounds average over an all-reduce group (DiLoCo), not with a paired replica (NoLoCo)"""
    replicas_of_stage: int | None
    """live replicas of our own stage, ours included (None = not looked up yet)"""
    outer_history: Sequence[dict]
    """sync counters' history: one dict per round with 'outcome' (and NoLoCo's 'reason')"""
    since_progress_s: float
    """seconds since our inner step last advanced (or since we started serving)"""
    waiting_for: str | None = None
    """what the node knowingly waits for before it can compute (then it is not stalled)"""
    done: bool = False
    """stage 0 trained all its steps (on a later stage: saw stage 0's replicas do so): nothing is
    expected to advance any more"""
    other_config_peers: int = 0
    """peers of this run seen with another manifest (config, tokenizer or model files not ours)"""
    copied_in_vain: bool = False
    """this node copied its stage's state because it was rounds behind, and has not paired since
    (node/catching_up.py: the copy landed behind too)"""


def attention(view: NodeView, *, stall_s: float = STALL_S) -> list[str]:
    """Warnings, most important first; [] when all is well."""
    notes = []
    if view.waiting_for is not None and view.other_config_peers:
        # Seen by a newcomer: a `--set` that changed the model made a swarm of one that waited forever.
        notes.append(
            f"{view.other_config_peers} peer(s) of this run use another config and never train with this node: "
            f"join with the swarm's config file, no --set changing model or data (`noloco-node doctor` checks)"
        )
    solo = _solo_note(view)
    if solo:
        notes.append(solo)
    if view.waiting_for is None and not view.done and view.since_progress_s >= stall_s:
        notes.append(_stall_note(view))
    return notes[:MAX_NOTES]


def for_record(notes: Sequence[str]) -> list[str]:
    """The notes as a DHT record carries them: each shortened to MAX_NOTE_CHARS at a word, marked
    with an ellipsis (the log and the terminal show them whole: a newcomer read 'raise timeouts.ma')."""
    short = []
    for note in notes[:MAX_NOTES]:
        if len(note) > MAX_NOTE_CHARS:
            note = note[: MAX_NOTE_CHARS - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
        short.append(note)
    return short


def _solo_note(view: NodeView) -> str | None:
    if not view.rounds_go_solo:
        return None
    latest = list(view.outer_history)[-SOLO_WINDOW:]
    if not latest or any(r.get("outcome") == "paired" for r in latest):
        return None
    if len(latest) < SOLO_WINDOW and view.replicas_of_stage != 1:
        return None  # a solo round or two happens; a lone replica is said at once
    n = len(latest)
    rounds = f"the last {n} outer rounds went solo" if n > 1 else "the last outer round went solo"
    if view.replicas_of_stage == 1:
        return (
            f"{rounds}: stage {view.stage} has no second replica to average with (a node that joins stage "
            f"{view.stage}, `join --stage {view.stage}`, fixes it)"
        )
    if all(r.get("reason") == "rejected" for r in latest):
        # Each partner's snapshot failed the check (sync/snapshot.py check_snapshot): the log's
        # 'rejected' lines say why. A hostile-peer audit saw this after a stranger averaged scaled
        # weights into a replica, and the note blamed match_s.
        return (
            f"{rounds}: every partner's weights were refused (too far from this node's, or not finite: the "
            f"log's 'rejected' lines): the replicas of stage {view.stage} drifted apart, or a peer sends bad weights "
            f"(in an open swarm any peer may pair: a swarm key closes it)"
        )
    if all(r.get("reason") == "replicas ahead" for r in latest):
        # Replicas more than 2 rounds apart are not waited for (sync/catch_up.py); a node left
        # behind copies their state (node/catching_up.py), topped up when the copy took rounds.
        if view.copied_in_vain:
            return (
                f"{rounds}: stage {view.stage}'s other replicas are rounds ahead; its copy of their state landed "
                f"behind too (slower than their rounds): a faster link or a smaller stage"
            )
        return (
            f"{rounds}: the other replicas of stage {view.stage} are rounds ahead and pair without this node; "
            f"it copies their state once it can reach one (or `join` again)"
        )
    if view.all_reduce:
        return (
            f"{rounds}: the all-reduce group never formed in time (a loaded machine or a slow link); "
            f"raise timeouts.match_s"
        )
    return (
        f"{rounds}: no replica of stage {view.stage} paired within timeouts.match_s (one that left or stopped, "
        f"a loaded machine, a slow link, or unreachable partners: see `noloco-node status`); where its other "
        f"replicas are live and reachable, raise timeouts.match_s"
    )


def _stall_note(view: NodeView) -> str:
    minutes = view.since_progress_s / 60
    since = (
        f"no inner step for {minutes:.0f} min" if minutes >= 2 else f"no inner step for {view.since_progress_s:.0f} s"
    )
    if view.stage == 0:
        return (
            f"{since}: microbatches are not coming back (a later stage slow, overloaded or unreachable); "
            f"see `noloco-node status`"
        )
    return (
        f"{since}: no microbatches arrive from stage {view.stage - 1} (its replicas finished, stopped, or "
        f"cannot reach this node); see `noloco-node status` and `noloco-node doctor`"
    )


class Progress:
    """When the node last advanced, and what it knowingly waits for, on the node's own clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._step = -1
        self._at = clock()
        self.waiting_for: str | None = None
        self._waiting_since = self._at

    def observe(self, inner_step: int) -> None:
        if inner_step != self._step:
            self._step, self._at = inner_step, self.clock()

    def since_progress_s(self) -> float:
        return self.clock() - self._at

    def wait(self, what: str | None) -> None:
        """Start (or keep) waiting for `what`; None = no longer waiting (progress counts from now)."""
        now = self.clock()
        if what != self.waiting_for:
            self._waiting_since = now
        if what is None and self.waiting_for is not None:
            self._at = now
        self.waiting_for = what

    def waiting_text(self) -> str | None:
        """E.g. 'waiting for a stage-1 replica; 12 s'."""
        if self.waiting_for is None:
            return None
        return f"waiting for {self.waiting_for}; {self.clock() - self._waiting_since:.0f} s"


def swarm_attention(rows: Sequence[dict], num_stages: int, *, behind_steps: int) -> list[str]:
    """What needs attention in a whole swarm, from its live records (`noloco-node status`): empty
    or lone stages, replicas far behind their stage or only relayed, and each node's own notes."""
    notes = []
    live = [r for r in rows if r.get("status") not in (Status.LEAVING, Status.JOINING)]
    for s in range(num_stages):
        here = [r for r in live if r["stage"] == s]
        if not here:
            notes.append(
                f"stage {s} has no replica: nothing trains until one joins (`noloco-node join --stage auto` takes it)"
            )
        elif len(here) == 1:
            notes.append(f"stage {s} has a single replica: its outer rounds have nobody to average with")
        else:
            lead = max(r["inner_step"] for r in here)
            for r in here:
                if lead - r["inner_step"] > behind_steps:
                    notes.append(
                        f"replica {r['peer_id'][-8:]} (stage {s}) is {lead - r['inner_step']} inner steps "
                        f"behind its stage: a slow machine or link"
                    )
    for r in live:
        if r.get("reach") == "relayed":
            notes.append(
                f"replica {r['peer_id'][-8:]} (stage {r['stage']}) is reached only through a relay (slower): "
                f"forward its port and pass --announce-addr; `noloco-node doctor` says how"
            )
        # Said by the replica of itself, in its record: attributed, never the swarm's own word.
        notes.extend(
            f"replica {r['peer_id'][-8:]} (stage {r['stage']}) says: {note}" for note in r.get("attention") or []
        )
    return notes
