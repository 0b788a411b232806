"""The rebalancing plan: which single move (if any) the swarm makes, decided from the records alone."""

import asyncio
import dataclasses
import time

import pytest

from noloco_node.pipeline.rebalance import Replica, plan_move, watch

NOW = 1000.0


def plan(replicas, margin=0.75, settle_s=10.0, cooldown_s=100.0, num_stages=2):
    return plan_move(replicas, num_stages, margin=margin, now=NOW, settle_s=settle_s, cooldown_s=cooldown_s)


def swarm(stages_caps, movable=True, load=1.0, **kw):
    """Replicas with these capacities, each doing `load` of its capacity (1.0 = saturated)."""
    return [
        Replica(f"peer{s}{i}", s, cap, throughput=load * cap, movable=movable, **kw)
        for s, caps in enumerate(stages_caps)
        for i, cap in enumerate(caps)
    ]


def test_three_plus_one_moves_one_node_to_the_starved_stage():
    move = plan(swarm([[1.0, 1.0, 1.0], [1.0]]))
    assert move is not None and (move.source, move.target) == (0, 1)
    assert move.peer_id == "peer00"  # ties: the lowest peer id
    assert move.throughput_now == 1.0 and move.throughput_after == pytest.approx(2.0)


def test_two_plus_two_stays_put_and_a_move_back_is_never_planned():
    assert plan(swarm([[1.0, 1.0], [1.0, 1.0]])) is None
    # The state right after a 3+1 -> 2+2 move (the mover measured on its new stage): no swap back.
    after = swarm([[1.0, 1.0], [1.0]]) + [Replica("mover", 1, 1.0, movable=True, moved_at=NOW - 50)]
    assert plan(after) is None


def test_margin_is_the_threshold():
    # 2 + 1 with equal speeds: today 1.0, after a move 1.0 (stage 0 drops to 1): no gain, no move.
    assert plan(swarm([[1.0, 1.0], [1.0]])) is None
    # A slow stage 1 (0.5 vs 2 x 1.0): moving one stage-0 node gives min(1.0, 0.5 + 0.5) = 1.0.
    slow = swarm([[1.0, 1.0], [0.5]])
    assert plan(slow, margin=0.75) is not None  # 0.5 < 0.75 x 1.0
    assert plan(slow, margin=0.4) is None  # 0.5 >= 0.4 x 1.0


def test_capacity_on_the_target_is_scaled_by_the_stages_cost():
    # Stage 1 costs twice as much per sequence (its replicas measure half): a stage-0 node of 2.0
    # would sustain 1.0 there. 4 x 2.0 vs 2 x 1.0: move -> min(6.0, 3.0) = 3.0.
    move = plan(swarm([[2.0, 2.0, 2.0, 2.0], [1.0, 1.0]]))
    assert move is not None and move.throughput_after == pytest.approx(3.0)


def test_the_fastest_useful_mover_is_chosen():
    replicas = [
        Replica("a", 0, 1.0, 1.0, movable=True),
        Replica("b", 0, 3.0, 3.0, movable=True),
        Replica("c", 0, 1.0, 1.0, movable=True),
        Replica("d", 1, 1.0, 1.0, movable=True),
    ]
    move = plan(replicas)
    # Moving b (3.0, estimated 3.0 x 1.0 / (5/3) = 1.8 on stage 1): min(2.0, 2.8) = 2.0; moving a: min(4.0, 1.6).
    assert move.peer_id == "b"


@pytest.mark.parametrize(
    "change",
    [
        dict(status="leaving"),
        dict(status="joining"),
        dict(moved_at=NOW - 5.0),
    ],
)
def test_no_plan_while_the_swarm_is_unsettled(change):
    replicas = swarm([[1.0, 1.0, 1.0], [1.0]])
    replicas[1] = Replica(replicas[1].peer_id, 0, 1.0, 1.0, movable=True, **{"status": "serving", **change})
    assert plan(replicas) is None


def test_a_limiting_stage_with_room_to_spare_draws_no_node():
    # Stage 1 is the smallest (1.0 vs 3.0) but does only half of what it can: the swarm is held
    # back elsewhere (the drivers' issue rate, the links), and a move would only lose a driver.
    idle_target = swarm([[1.0, 1.0, 1.0], [1.0]], load=0.5)
    assert plan(idle_target) is None
    busy = swarm([[1.0, 1.0, 1.0], [1.0]], load=0.7)
    assert plan(busy) is not None
    # One fast replica busy and two slow ones idle (capacity routing sends them little): together
    # 1.0 of 2.0, not saturated.
    mixed = swarm([[2.0, 2.0, 2.0]]) + [
        Replica("s0", 1, 1.0, 1.0, movable=True),
        Replica("s1", 1, 0.5, 0.0, movable=True),
        Replica("s2", 1, 0.5, 0.0, movable=True),
    ]
    assert plan(mixed) is None


def test_pinned_nodes_cooldown_and_last_replicas_never_move():
    assert plan(swarm([[1.0, 1.0, 1.0], [1.0]], movable=False)) is None
    recently_moved = swarm([[1.0, 1.0, 1.0], [1.0]], moved_at=NOW - 50.0)  # settled, but within the cooldown
    assert plan(recently_moved) is None
    # Stage 0 has a single replica: it cannot leave it even though stage 1 is weaker per replica.
    assert plan([Replica("a", 0, 5.0, movable=True), Replica("b", 1, 1.0, movable=True)]) is None


def test_unmeasured_replicas_count_as_their_stages_mean_and_an_unmeasured_stage_waits():
    assert plan(swarm([[1.0, 0.0, 1.0], [1.0]])) is not None
    assert plan(swarm([[1.0, 1.0, 1.0], [0.0]])) is None


class SharedRecords:
    """A DHT the watchers share: their claims land in it; each reader may see capacities its own way."""

    def __init__(self, replicas):
        self.replicas = {r.peer_id: r for r in replicas}
        self.claims = []

    def reader(self, capacity_seen=None):
        async def read():
            seen = {**{k: r.capacity for k, r in self.replicas.items()}, **(capacity_seen or {})}
            return [dataclasses.replace(r, capacity=seen[k]) for k, r in self.replicas.items()]

        return read

    def claimer(self, me):
        async def claim(claimed_at):
            self.claims.append((me, claimed_at))
            self.replicas[me] = dataclasses.replace(self.replicas[me], move_claimed_at=claimed_at)

        return claim


def watcher(records, me, read=None, period_s=0.01):
    return watch(
        me=me,
        read=read or records.reader(),
        claim=records.claimer(me),
        num_stages=2,
        margin=0.75,
        period_s=period_s,
        settle_s=1.0,
        cooldown_s=1.0,
        clock=lambda: NOW + time.monotonic(),
    )


def test_watch_returns_only_the_move_that_names_us():
    records = SharedRecords(swarm([[1.0, 1.0, 1.0], [1.0]]))

    async def run(me):
        return await asyncio.wait_for(watcher(records, me), timeout=0.5)

    assert asyncio.run(run("peer00")).target == 1
    assert records.claims[-1][0] == "peer00" and records.replicas["peer00"].move_claimed_at > 0  # claimed, kept
    records = SharedRecords(swarm([[1.0, 1.0, 1.0], [1.0]]))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(run("peer01"))  # the plan names peer00: peer01 keeps watching, never claims
    assert records.claims == []


def test_a_claim_in_the_dht_holds_every_plan():
    claimed = swarm([[1.0, 1.0, 1.0], [1.0]])
    assert plan(claimed) is not None
    claimed[1] = dataclasses.replace(claimed[1], move_claimed_at=NOW - 1)
    assert plan(claimed) is None


def test_two_nodes_named_by_different_views_move_one_of_them():
    """The race seen under load: each stage-0 driver's view named itself. Both claim; the later
    claimant sees the earlier claim and stays (and withdraws its claim); the earlier one moves."""
    records = SharedRecords(swarm([[1.0, 1.0, 1.0], [1.0]]))
    views = {"peer00": {"peer00": 0.9}, "peer01": {"peer01": 0.9}}  # each measured itself a little slower...
    for me, seen in views.items():  # ...so that each view names its reader
        assert plan(asyncio.run(records.reader(seen)())).peer_id == me

    async def race():
        tasks = {
            me: asyncio.create_task(watcher(records, me, records.reader(seen), period_s=0.05))
            for me, seen in views.items()
        }
        done, pending = await asyncio.wait(tasks.values(), timeout=1.5)
        for task in pending:
            task.cancel()
        return {me for me, t in tasks.items() if t in done}

    for _ in range(5):  # the order of the claims is up to the event loop's timing: several tries
        records.__init__(swarm([[1.0, 1.0, 1.0], [1.0]]))
        moved = asyncio.run(race())
        assert len(moved) == 1, (moved, records.claims)
        [mover] = moved
        first_claim = min(records.claims, key=lambda c: c[1])
        assert first_claim[0] == mover
        assert all(r.move_claimed_at == 0 for k, r in records.replicas.items() if k != mover)  # withdrawn


def test_a_claimant_moves_though_a_fellow_replica_now_measures_a_little_better():
    """Capacities are measured: between the claim and its check, which replica of a stage is best
    flips with noise of a few percent. The claimant moves if its own move still clears the margin;
    a check that it is still the best made claims fail over and over in a real swarm."""
    records = SharedRecords(swarm([[1.0, 1.0, 1.0], [1.0]]))
    views = iter([{}, {"peer01": 1.05}])  # the first read names peer00; the check sees peer01 ahead

    async def read():
        return await records.reader(next(views, {"peer01": 1.05}))()

    assert plan(asyncio.run(records.reader({"peer01": 1.05})())).peer_id == "peer01"
    move = asyncio.run(asyncio.wait_for(watcher(records, "peer00", read), timeout=0.5))
    assert (move.peer_id, move.source, move.target) == ("peer00", 0, 1)
    assert records.replicas["peer00"].move_claimed_at > 0


def test_a_claimant_whose_own_move_no_longer_pays_withdraws():
    records = SharedRecords(swarm([[1.0, 1.0, 1.0], [1.0]]))
    views = iter([{}, {"peer10": 3.0}])  # at the check, stage 1 measures as fast as stage 0

    async def read():
        return await records.reader(next(views, {"peer10": 3.0}))()

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(watcher(records, "peer00", read), timeout=0.3))
    assert records.claims[0][0] == "peer00" and records.claims[-1] == ("peer00", 0.0)  # claimed, then withdrawn
    assert records.replicas["peer00"].move_claimed_at == 0
