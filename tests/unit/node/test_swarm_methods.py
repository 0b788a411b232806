"""Each outer method's effect on a whole in-process swarm (node/in_process.py), read through the
swarm's own summaries (replica_spread, outer_rounds, routes, validation_loss) that
`noloco-node demo --local` writes: NoLoCo with an odd replica learns, routes everywhere and counts
its solo rounds; DiLoCo and dp leave the replicas on one set of weights; `none` lets them drift."""

import math

from .conftest import tiny_config
from .test_swarm_in_process import dp_config, run


def test_noloco_with_three_replicas_learns_routes_everywhere_and_counts_solo_rounds(tmp_path):
    steps, every = 12, 4
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": every,
            "pipeline.num_stages": 2,
            "timeouts.match_s": 3.0,
        },
    )
    swarm = run(config, replicas=3, steps=steps)
    for node in swarm.stage(0):
        losses = node.driver.log.step_losses
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    # 3 rounds x 2 stages x 3 replicas; three replicas never all pair: one (at least) goes solo.
    outer = swarm.outer_rounds()
    assert outer["rounds"] == 18 and outer["paired"] + outer["solo"] == 18, outer
    for stage in (0, 1):
        for index in range(1, steps // every + 1):
            rounds = [r for n in swarm.stage(stage) for r in n.sync.counters.history if r["round"] == index]
            assert len(rounds) == 3 and any(r["outcome"] == "solo" for r in rounds), (stage, index, rounds)
    # Every pair has two sides, each of which used the other's snapshot (paired) or refused it
    # (rejected, counted solo: the integrity bound can refuse an honest partner that drifted far).
    assert outer["solo"] >= 6 and (outer["paired"] + outer["rejected"]) % 2 == 0, outer
    routes = swarm.routes()
    assert set(routes) == {"s1r0", "s1r1", "s1r2"}
    assert all(set(received) == {"s0r0", "s0r1", "s0r2"} for received in routes.values()), routes
    assert swarm.replica_spread() > 0


def test_diloco_leaves_every_replica_on_the_same_weights(tmp_path):
    every = 2
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "diloco",
            "outer.inner_steps_per_outer": every,
            "outer.allreduce_group_size": 3,
            "pipeline.num_stages": 2,
            "pipeline.batch_size": 6,
        },
    )
    swarm = run(config, replicas=3, steps=every)  # ends on a round: theta <- the shared phi
    assert swarm.outer_rounds()["rounds"] == 6
    assert swarm.replica_spread() < 1e-6


def test_dp_keeps_replicas_identical_every_step(tmp_path):
    swarm = run(dp_config(tmp_path), replicas=2, steps=1)
    assert swarm.replica_spread() < 1e-7


def test_none_lets_replicas_drift(tmp_path):
    config = tiny_config(tmp_path, **{"outer.method": "none", "pipeline.num_stages": 2})
    swarm = run(config, replicas=2, steps=3)
    assert swarm.outer_rounds()["rounds"] == 0
    assert swarm.replica_spread() > 1e-4
    val = swarm.validation_loss([batch for _, batch in zip(range(2), swarm.batches(swarm.stage(0)[0]))])
    assert math.isfinite(val) and val > 0  # a loss from each column of stages
