"""A joiner's state, fetched from several donors at once and resumed past a donor that fails.

The stage's parameters are split into one part per donor (up to `max_donors`), balanced by their
payload bytes in the chosen encoding; a parameter is never split, so its phi, m and both Adam
moments come from one donor and agree with each other. The parts are fetched concurrently, so the
donors' uplinks add up. A donor that fails mid-transfer costs only the parameters it had not sent
whole: they go to another live donor (one not used yet, else one that finished its part), at most
`max_retries` times in all (each failed donor is dropped), each fetch under the transport's own deadlines.

Counters: inner_step and outer_round come from the donor furthest along (the largest inner step)
among those whose parameters we keep: the joiner then starts at the newest round any of its state
reached, never behind a donor it copied from (a round behind, its first exchange would be refused
as stale). Each parameter's Adam step count comes from the donor that sent that parameter, so it
matches the moments it came with."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from noloco_node.codec.state_layout import ADAM_KINDS, ReceivedState, parameter_bytes, split_name, tensors_by_parameter
from noloco_node.errors import NodeError, PeerBusy

log = logging.getLogger(__name__)

Expected = dict[str, tuple[tuple[int, ...], torch.dtype]]
BUSY_WAIT_S = 2.0
"""How long a joiner waits before asking a busy donor (RESOURCE_EXHAUSTED: it serves its most
state transfers at once, rpc/state_slots.py) again when no other donor is free; doubled each time."""
MAX_BUSY_WAITS = 4
"""Times a joiner asks a busy donor again, all donors together (2 + 4 + 8 + 16 s of waiting), besides
`max_retries`."""


class StateSource(Protocol):
    """Fetches one donor's state of some parameters (rpc/state_service.py over gRPC,
    sync/memory.py in one process)."""

    async def fetch_state(
        self,
        peer_id: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: Expected,
        names: Sequence[str] = (),
        compact: bool = False,
        into: ReceivedState | None = None,
    ) -> tuple[dict[str, Tensor], dict]: ...

    async def top_up_state(
        self, peer_id: str, *, stage: int, requester: str, timeout_s: float, expected: Expected, names: Sequence[str]
    ) -> tuple[dict[str, Tensor], dict]:
        """phi/<p> of `names` as the difference since what `peer_id` sent us (sync/top_up.py)."""
        ...


class StateUnavailable(NodeError):
    """No live donor was left for some parameters (or the retries ran out)."""


CLAIM_SLACK_ROUNDS, CLAIM_SLACK_MIN_STEPS = 4, 100
"""How far past the step a stage's records agree on a donor's claim may go (rounds, at least steps)."""


def agreed_step(steps: Sequence[int]) -> int | None:
    """The inner step a stage's replicas' records agree on: the lower median of their claims. A
    record says what its writer likes (a hostile-peer audit's claimed 3,495 steps ahead of three
    honest replicas: one of them copied its state and took that step, then the rest copied that
    one); one claim, or a minority of them, does not move the median."""
    if not steps:
        return None
    ordered = sorted(steps)
    return ordered[(len(ordered) - 1) // 2]


def claim_limit(steps: Sequence[int], round_steps: int) -> int | None:
    """The furthest inner step a donor may claim, in its record or its stream's counters: a few
    rounds past the agreed step (honest replicas of one stage run that close; records lag)."""
    agreed = agreed_step(steps)
    return None if agreed is None else agreed + max(CLAIM_SLACK_ROUNDS * round_steps, CLAIM_SLACK_MIN_STEPS)


@dataclass
class FetchedState:
    tensors: dict[str, Tensor]
    counters: dict
    """inner_step and outer_round of the donor furthest along; adam_steps per parameter from the
    donor that sent it."""
    parameters_from: dict[str, int]
    """Donor -> parameters taken from it."""
    reasked: int = 0
    """Parameters asked for again after their first donor failed."""
    failed: list[str] = field(default_factory=list)
    """Donors that failed mid-transfer (or refused, other than busy)."""
    busy: int = 0
    """Times a donor answered busy (RESOURCE_EXHAUSTED) before sending anything."""
    owner: dict[str, str] = field(default_factory=dict)
    """Parameter -> the donor whose copy of it we kept (a top-up asks that donor: sync/top_up.py)."""

    @property
    def donor(self) -> str:
        """The donor furthest along (whose counters we took)."""
        return self.counters["donor"]


def progress(counters: dict) -> tuple[int, int]:
    """How far a donor's counters are along (inner step, then outer round): the furthest is taken."""
    return int(counters["inner_step"]), int(counters["outer_round"])


def donor_order(candidates: Sequence[tuple[str, str]], seed: str) -> list[str]:
    """The donors to ask, from (peer id, reach) pairs: in a random order drawn from `seed` (so that
    joiners spread over the replicas), those reached without a relay first. The first `max_donors`
    are asked at once; a relayed donor's part runs through a relay, on a home uplink."""
    shuffled = list(candidates)
    random.Random(seed).shuffle(shuffled)
    return [peer for peer, reach in sorted(shuffled, key=lambda c: c[1] == "relayed")]


def split_parameters(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """`sizes` (parameter -> bytes) cut into `parts` lists of whole parameters with nearly equal
    byte totals: largest first, each to the lightest part (its total is at most the mean plus the
    largest parameter). Each part keeps the parameters in `sizes`' order; empty parts are dropped."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    totals, members = [0] * parts, [set() for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        lightest = min(range(parts), key=lambda i: (totals[i], i))
        totals[lightest] += sizes[name]
        members[lightest].add(name)
    return [[n for n in sizes if n in chosen] for chosen in members if chosen]


def whole_parameters(received: ReceivedState, expected: Expected, names: Sequence[str]) -> list[str]:
    """Of `names`, those whose every tensor arrived: phi and m, and both Adam moments when the
    donor's counters list an Adam step for the parameter (it sends them then)."""
    if received.counters is None:
        return []
    with_adam = received.counters.get("adam_steps", {})
    grouped = tensors_by_parameter(expected)
    return [
        p
        for p in names
        if all(
            t in received.tensors for t in grouped.get(p, ()) if split_name(t)[0] not in ADAM_KINDS or p in with_adam
        )
    ]


async def fetch_from_donors(
    source: StateSource,
    donors: Sequence[str],
    *,
    stage: int,
    requester: str,
    timeout_s: float,
    expected: Expected,
    compact: bool = True,
    max_donors: int = 4,
    max_retries: int = 3,
    max_inner_step: int | None = None,
) -> FetchedState:
    """The whole state in `expected` from `donors` (in order of preference; the first
    `max_donors` start at once, the rest stand by). A donor whose counters are past
    `max_inner_step` (claim_limit) counts as failed: none of its state is kept. Raises
    StateUnavailable when some parameters could not be had from anyone."""
    if not donors or not expected:
        raise StateUnavailable("no donor to fetch from" if not donors else "nothing to fetch")
    transfers = _Transfers(
        source,
        stage=stage,
        requester=requester,
        timeout_s=timeout_s,
        expected=expected,
        compact=compact,
        max_inner_step=max_inner_step,
    )
    sizes = parameter_bytes(expected, compact)
    standby = list(donors)
    first = [standby.pop(0) for _ in range(min(max_donors, len(standby)))]
    for donor, names in zip(first, split_parameters(sizes, len(first))):
        transfers.start(donor, names)
    try:
        await transfers.run(standby, max_retries=max_retries, parameters=len(sizes))
    finally:
        await transfers.cancel()
    return transfers.fetched()


class _Transfers:
    """The running state transfers of one `fetch_from_donors`, and the whole parameters they
    delivered, each with the donor that sent it."""

    def __init__(
        self,
        source: StateSource,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: Expected,
        compact: bool,
        max_inner_step: int | None = None,
    ) -> None:
        self.source, self.stage, self.requester, self.timeout_s = source, stage, requester, timeout_s
        self.expected, self.compact = expected, compact
        self.grouped = tensors_by_parameter(expected)
        self.running: dict[asyncio.Task, tuple[str, list[str], ReceivedState]] = {}
        self.kept: dict[str, Tensor] = {}
        self.owner: dict[str, str] = {}
        self.counters_of: dict[str, dict] = {}
        self.result = FetchedState({}, {}, {})
        self.max_inner_step = max_inner_step

    def start(self, donor: str, names: list[str], delay_s: float = 0.0) -> None:
        """Ask `donor` for the state of the parameters `names` (after `delay_s`)."""
        into = ReceivedState()
        task = asyncio.create_task(self._ask(donor, names, into, delay_s))
        self.running[task] = (donor, names, into)

    async def _ask(self, donor: str, names: list[str], into: ReceivedState, delay_s: float):
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return await self.source.fetch_state(
            donor,
            stage=self.stage,
            requester=self.requester,
            timeout_s=self.timeout_s,
            expected={t: self.expected[t] for p in names for t in self.grouped[p]},
            names=names,
            compact=self.compact,
            into=into,
        )

    async def run(self, standby: list[str], *, max_retries: int, parameters: int) -> None:
        """Settle each transfer as it ends, handing a failed donor's missing parameters to a donor
        on `standby`, until none runs; raises StateUnavailable when some are left with no one to ask."""
        waiting: list[list[str]] = []
        busy: list[str] = []  # donors that refused as busy: asked again after a wait, when no other is free
        retries = busy_waits = 0
        while self.running:
            done, _ = await asyncio.wait(self.running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                donor, missing, was_busy = self._settle(task)
                if missing is None:
                    standby.append(donor)  # finished: it may take over a failed donor's part
                else:
                    waiting.append(missing)
                    busy += [donor] if was_busy else []
            while waiting and ((standby and retries < max_retries) or (busy and busy_waits < MAX_BUSY_WAITS)):
                names, delay_s = waiting.pop(0), 0.0
                if standby and retries < max_retries:
                    retries, donor = retries + 1, standby.pop(0)
                else:
                    delay_s, donor = BUSY_WAIT_S * 2**busy_waits, busy.pop(0)
                    busy_waits += 1
                self.result.reasked += len(names)
                log.info("asking %s for %d parameters another donor did not send", donor[-8:], len(names))
                self.start(donor, names, delay_s)
            if waiting and not self.running:
                raise StateUnavailable(
                    f"{sum(map(len, waiting))} of {parameters} parameters could not be fetched: "
                    f"donors {', '.join(d[-8:] for d in self.result.failed) or 'none'} failed, "
                    f"{self.result.busy} times one was busy, and no other donor is left or the "
                    f"{max_retries} retries are spent"
                )

    def _settle(self, task: asyncio.Task) -> tuple[str, list[str] | None, bool]:
        """Keep the whole parameters an ended transfer delivered; returns its donor, when it
        failed the parameters it did not deliver (None when it finished its part), and whether it
        refused as busy before sending anything (not a failed donor: it may be asked again)."""
        donor, names, into = self.running.pop(task)
        error = task.exception()
        if error is not None and not isinstance(error, (NodeError, asyncio.TimeoutError)):
            raise error
        whole = whole_parameters(into, self.expected, names)
        claimed = int(into.counters.get("inner_step", 0)) if into.counters else 0
        if self.max_inner_step is not None and claimed > self.max_inner_step:
            whole, error = (
                [],
                StateUnavailable(
                    f"its counters say inner step {claimed}, past the {self.max_inner_step} the stage's records allow"
                ),
            )
        for p in whole:
            self.kept.update({t: into.tensors[t] for t in self.grouped[p] if t in into.tensors})
            self.owner[p] = donor
        if whole:
            self.counters_of[donor] = into.counters
        missing = [p for p in names if p not in self.owner]
        if error is None and not missing:
            return donor, None, False
        if isinstance(error, PeerBusy) and not whole:
            self.result.busy += 1
            log.info("state donor %s is busy: %s", donor[-8:], error)
            return donor, missing, True
        reason = error or f"the stream ended without {len(missing)} parameters"
        log.warning(
            "state transfer from %s failed after %d of %d parameters: %s", donor[-8:], len(whole), len(names), reason
        )
        self.result.failed.append(donor)
        return donor, missing, False

    async def cancel(self) -> None:
        """Stop the transfers still running and wait until they have stopped."""
        for task in self.running:
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)

    def fetched(self) -> FetchedState:
        """The kept tensors, the counters of the donor furthest along, and who sent what."""
        counters_of, owner, result = self.counters_of, self.owner, self.result
        furthest = max(counters_of, key=lambda d: progress(counters_of[d]))
        result.tensors = self.kept
        result.counters = {
            "inner_step": int(counters_of[furthest]["inner_step"]),
            "outer_round": int(counters_of[furthest]["outer_round"]),
            "donor": furthest,
            "adam_steps": {
                p: counters_of[owner[p]]["adam_steps"][p]
                for p in owner
                if p in counters_of[owner[p]].get("adam_steps", {})
            },
        }
        for donor in owner.values():
            result.parameters_from[donor] = result.parameters_from.get(donor, 0) + 1
        result.owner = dict(owner)
        return result
