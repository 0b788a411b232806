"""A joiner's state copy brought up to date (a top-up), the joiner's side: ask every donor the copy
came from at once for the difference of its phi since (codec/top_up.py), and take the counters of
the donor furthest along.

A state copy at real size over a home uplink takes minutes (a `medium` stage: 3.7 GB compact, ~12.6
min from two donors at 20 Mbit/s) while the donors train on; the joiner then starts rounds behind
the stage's replicas, further than the catch-up wait reaches (sync/catch_up.py), and pairs with
nobody. The top-up is about a ninth of the copy's bytes, so it lands within the catch-up's reach
for a copy of up to ~16 rounds. The outer momentum and Adam's moments stay as copied: statistics
a few rounds old (m's weight in the next update is alpha, and shrinks by alpha each round)."""

from __future__ import annotations

import asyncio

from torch import Tensor

from noloco_node.errors import PeerBusy
from noloco_node.sync.state_fetch import BUSY_WAIT_S, MAX_BUSY_WAITS, Expected, StateSource, progress


async def top_up_from_donors(
    source: StateSource, owner: dict[str, str], *, stage: int, requester: str, timeout_s: float, expected: Expected
) -> tuple[dict[str, Tensor], dict]:
    """Every donor's top-up of the parameters we kept from it (`owner`: parameter -> donor), all at
    once: the phi/<p> differences and the counters of the donor furthest along. All or nothing: a
    donor that fails raises its error (a NodeError) and the copy stays as it was; a busy donor
    (RESOURCE_EXHAUSTED) is asked again after a wait, up to MAX_BUSY_WAITS times."""
    by_donor: dict[str, list[str]] = {}
    for parameter, donor in owner.items():
        by_donor.setdefault(donor, []).append(parameter)
    calls = [
        asyncio.ensure_future(
            _patiently(
                lambda donor=donor, names=names: source.top_up_state(
                    donor,
                    stage=stage,
                    requester=requester,
                    timeout_s=timeout_s,
                    expected={f"phi/{p}": expected[f"phi/{p}"] for p in names},
                    names=names,
                )
            )
        )
        for donor, names in by_donor.items()
    ]
    try:
        answers = await asyncio.gather(*calls)
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    differences: dict[str, Tensor] = {}
    for part, _ in answers:
        differences.update(part)
    inner_step, outer_round = max(progress(c) for _, c in answers)
    return differences, {"inner_step": inner_step, "outer_round": outer_round}


async def _patiently(call):
    """`call()`'s answer, asking again after BUSY_WAIT_S (doubled each time) while it is busy."""
    for wait in range(MAX_BUSY_WAITS):
        try:
            return await call()
        except PeerBusy:
            await asyncio.sleep(BUSY_WAIT_S * 2**wait)
    return await call()
