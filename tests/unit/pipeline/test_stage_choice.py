"""`--stage auto` with simultaneous joiners: claim, settle, agree (pipeline/stage_choice.py)."""

import asyncio

from noloco_node.pipeline.stage_choice import Claim, assign_stage, claim_stage

SETTLE = 3.0


def replicas(*stages: list[float]) -> list[dict[str, float]]:
    """Serving replicas per stage, with made-up peer ids: [0.0], [0.0] -> one unmeasured on each."""
    return [{f"replica-{s}-{i}": c for i, c in enumerate(caps)} for s, caps in enumerate(stages)]


def test_two_contenders_split_where_a_lone_joiner_would_pick_one_stage():
    capacities = replicas([0.0], [0.0])  # one unmeasured replica on each of two stages
    claims = [Claim("peer-a", 0, 100.0), Claim("peer-b", 0, 100.5)]  # both first claimed stage 0
    a = assign_stage(capacities, claims, "peer-a", 100.0, SETTLE)
    b = assign_stage(capacities, claims, "peer-b", 100.5, SETTLE)
    assert {a, b} == {0, 1}


def test_contenders_follow_measured_capacity_with_newcomers_counted_as_typical():
    capacities = replicas([10.0, 10.0], [4.0])  # stage 1 sustains least, by 16 sequences/s
    claims = [Claim(f"peer-{c}", 1, 50.0) for c in "abc"]
    stages = [assign_stage(capacities, claims, f"peer-{c}", 50.0, SETTLE) for c in "abc"]
    assert stages == [1, 1, 0]  # 4 -> 12 -> 20 on stage 1, then stage 0 (20) ties and wins by index


def test_a_settled_claim_counts_as_taken_and_is_not_reassigned():
    capacities = replicas([0.0], [0.0])
    claims = [Claim("peer-z", 0, 10.0)]  # claimed long before us and decided without seeing us
    assert assign_stage(capacities, claims, "peer-a", 20.0, SETTLE) == 1
    assert assign_stage(replicas([0.0], [0.0]), [], "peer-a", 20.0, SETTLE) == 0  # alone: the lowest index


def test_claim_stage_reclaims_when_the_agreement_moves_it():
    announced = []

    async def serving():
        return replicas([0.0], [0.0])

    async def claims():
        return [Claim("peer-a", 0, 0.0), Claim("peer-b", 0, 0.0)]

    async def announce(stage, withdrawn, claimed_at):
        announced.append((stage, withdrawn))

    async def run(me):
        return await claim_stage(
            serving=serving, claims=claims, announce_claim=announce, me=me, settle_s=0.01, clock=lambda: 0.0
        )

    assert asyncio.run(run("peer-a")) == 0
    assert announced == [(0, None)]
    assert asyncio.run(run("peer-b")) == 1
    assert announced[1:] == [(0, None), (1, 0)]  # claimed 0, then moved to 1 and withdrew 0


def test_a_claim_seen_late_is_not_yielded_to_by_the_earlier_claimant():
    # "peer-a" claimed 3.5 s after "peer-b" (more than SETTLE); b's slow lookup still saw a's claim.
    # a counts b's claim as settled; b must not treat a as a contender, or both yield stage 0.
    capacities = replicas([0.0, 0.0], [0.0, 0.0])
    claims = [Claim("peer-b", 0, 100.0), Claim("peer-a", 0, 100.0 + SETTLE + 0.5)]
    assert assign_stage(capacities, claims, "peer-a", 100.0 + SETTLE + 0.5, SETTLE) == 1
    assert assign_stage(capacities, claims, "peer-b", 100.0, SETTLE) == 0


def test_a_contender_already_serving_counts_once_and_the_contenders_still_split():
    # Two joiners claim stage 0 of [2, 2] at once. peer-a decides first and serves within the second;
    # peer-b reads the claims before that and the replicas after: a counted as a claim and as a
    # replica of stage 0 sent both to stage 0 (seen in a full suite run). A claimant counts by its claim.
    claims = [Claim("peer-a", 0, 100.0), Claim("peer-b", 0, 100.2)]
    before = replicas([0.0, 0.0], [0.0, 0.0])
    after = [dict(before[0], **{"peer-a": 0.0}), before[1]]
    a = assign_stage(before, claims, "peer-a", 100.0, SETTLE)
    b = assign_stage(after, claims, "peer-b", 100.2, SETTLE)
    assert (a, b) == (0, 1)
    assert assign_stage(after, [], "peer-b", 100.2, SETTLE) == 1  # its claim gone, a is one replica of stage 0
