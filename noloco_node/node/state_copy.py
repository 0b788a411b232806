"""A joiner's copy of its stage's training state, before it announces itself: phi, m, Adam's
moments and the counters from the stage's live replicas (sync/state_fetch.py), and, when that copy
took so long that the replicas are an outer round or more further on, its top-up
(sync/top_up.py)."""

from __future__ import annotations

import logging
import time

from noloco_node.dht.directory import PeerDirectory
from noloco_node.errors import NodeError
from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.state import OuterState
from noloco_node.rpc.outer_service import OuterClient
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.state_fetch import FetchedState, claim_limit, donor_order, fetch_from_donors
from noloco_node.sync.top_up import top_up_from_donors
from noloco_node.sync.transfer import apply_top_up, expected_tensors, import_state

log = logging.getLogger(__name__)


async def fetch_state(
    directory: PeerDirectory,
    client: OuterClient,
    compute: ComputeThread,
    state: OuterState,
    inner: InnerOptimizer,
    *,
    stage: int,
    peer_id: str,
    timeout_s: float,
    compact: bool = True,
    max_donors: int = 4,
    round_steps: int = 0,
) -> dict | None:
    """Copy phi, m, Adam moments and counters (theta <- phi) from up to `max_donors` live replicas
    of the stage at once, compactly unless `compact` is False; top the copy up when the replicas
    are `round_steps` (a round) or more further on by then (module doc). Returns {donor (the one
    furthest along), inner_step, outer_round, donors (parameters from each), reasked, failed,
    topped_up (steps the top-up moved us on, or None)}, or None (no replica, or no state could
    be had: the run's initial weights stay)."""
    replicas = [r for r in await directory.replicas(stage, fresh=True) if r.peer_id != peer_id]
    plausible, limit = _plausible(replicas, round_steps)
    donors = donor_order([(r.peer_id, r.reach) for r in plausible], seed=peer_id)
    if not donors:
        return None
    began = time.monotonic()
    try:
        fetched = await fetch_from_donors(
            client,
            donors,
            stage=stage,
            requester=peer_id,
            timeout_s=timeout_s,
            expected=expected_tensors(state),
            compact=compact,
            max_donors=max_donors,
            max_inner_step=limit,
        )
        step = await compute.run(import_state, state, inner, fetched.tensors, fetched.counters)
    except NodeError as exc:
        log.warning("state transfer failed (%s); this node keeps its own state (its checkpoint if it has one)", exc)
        return None
    now = {"inner_step": step, "outer_round": int(fetched.counters["outer_round"])}
    topped_up, note = None, ""
    live = max(
        (
            r.inner_step
            for r in await directory.replicas(stage, fresh=True)
            if r.peer_id != peer_id and (limit is None or r.inner_step <= limit)
        ),
        default=0,
    )
    if round_steps and live - step >= round_steps:
        if (
            counters := await _top_up(client, compute, state, inner, fetched.owner, stage, peer_id, timeout_s)
        ) is not None:
            now, topped_up = counters, counters["inner_step"] - step
        note = _behind_note(live - step, round_steps, topped_up)
    return _joined(fetched, now, topped_up, time.monotonic() - began, note)


def _plausible(replicas: list, round_steps: int) -> tuple[list, int | None]:
    """The replicas whose claimed inner step fits what the stage's records agree on, and the
    furthest step a donor may claim (sync/state_fetch.py claim_limit); the others are said."""
    limit = claim_limit([r.inner_step for r in replicas], round_steps)
    passed_over = [r for r in replicas if limit is not None and r.inner_step > limit]
    if passed_over:
        log.warning(
            "not copying from %s: their records claim inner steps past the %s the stage's other records allow",
            ", ".join(r.peer_id[-8:] for r in passed_over),
            limit,
        )
    return [r for r in replicas if r not in passed_over], limit


def _joined(fetched: FetchedState, now: dict, topped_up: int | None, took_s: float, note: str) -> dict:
    """Says where the joiner starts, and returns fetch_state's answer."""
    failed = ", ".join(d[-8:] for d in fetched.failed)
    sources = ", ".join(f"{d[-8:]} ({n} parameter tensors)" for d, n in fetched.parameters_from.items())
    reasked = f"; {fetched.reasked} parameter tensors asked again after {failed} failed" if fetched.failed else ""
    log.info(
        "joined at inner step %d, outer round %d with state from %s in %.1f s%s%s",
        now["inner_step"],
        now["outer_round"],
        sources,
        took_s,
        reasked,
        note,
    )
    return {
        "donor": fetched.donor,
        **now,
        "donors": fetched.parameters_from,
        "reasked": fetched.reasked,
        "failed": fetched.failed,
        "topped_up": topped_up,
    }


def _behind_note(behind: int, round_steps: int, topped_up: int | None) -> str:
    done = "not topped up" if topped_up is None else f"its phi topped up by {topped_up} steps"
    return f"; the copy was {behind} inner steps ({behind / round_steps:.1f} rounds) behind, {done}"


async def _top_up(
    client: OuterClient,
    compute: ComputeThread,
    state: OuterState,
    inner: InnerOptimizer,
    owner: dict[str, str],
    stage: int,
    peer_id: str,
    timeout_s: float,
) -> dict | None:
    """A copy's top-up from the donors it came from, applied (sync/top_up.py); its counters, or
    None when a donor could not give it (the copy stays as it was)."""
    began = time.monotonic()
    try:
        differences, counters = await top_up_from_donors(
            client, owner, stage=stage, requester=peer_id, timeout_s=timeout_s, expected=expected_tensors(state)
        )
    except NodeError as exc:
        log.warning("could not top up the state copy (it stays as copied): %s", exc)
        return None
    await compute.run(apply_top_up, state, inner, differences, counters)
    log.info(
        "top-up of %d parameters from %d donors in %.1f s: inner step %d",
        len(differences),
        len(set(owner.values())),
        time.monotonic() - began,
        counters["inner_step"],
    )
    return counters
