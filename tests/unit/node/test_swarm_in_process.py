"""Whole swarms in one process (node/in_process.py): every replica assembled exactly as a node is,
over the in-memory twins of the pipeline and pairing ports. The invariants the process tests
check, in seconds: every microbatch issued is completed or dropped, pairs form, the loss falls,
the pipeline in exact mode equals the whole model trained in one process, the overlap schedule's
staleness is bounded, and dp replicas stay identical (and come back together after a bad round)."""

import asyncio
import itertools

import pytest
import torch

from noloco_node.node.in_process import InProcessSwarm

from tests.oracle import train_whole_model
from .conftest import tiny_config


def run(config, *, replicas: int, steps: int, inject=None, timeout_s: float = 120.0) -> InProcessSwarm:
    async def go() -> InProcessSwarm:
        swarm = await InProcessSwarm(config, replicas=replicas).start()
        if inject is not None:
            inject(swarm)
        try:
            await swarm.train(steps, timeout_s)
        finally:
            await swarm.stop()
        return swarm

    return asyncio.run(go())


def assert_accounting(swarm: InProcessSwarm, steps: int) -> None:
    cfg = swarm.config.pipeline
    for node in swarm.stage(0):
        c = node.driver.counters
        assert c.issued == c.completed + c.dropped, c  # nothing silently lost
        assert c.completed == steps * cfg.batch_size // cfg.microbatch_size and c.dropped == 0, c
    assert all(node.worker.inner_steps == steps for node in swarm.nodes)


def test_two_by_two_trains_with_noloco_rounds_in_process(tmp_path):
    steps, every = 20, 5
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": every,
            "pipeline.num_stages": 2,
            "timeouts.match_s": 3.0,
        },
    )
    swarm = run(config, replicas=2, steps=steps)
    assert_accounting(swarm, steps)
    for node in swarm.nodes:
        history = node.sync.counters.history
        assert [r["round"] for r in history] == list(range(1, steps // every + 1)), (node.peer_id, history)
        # Two replicas per stage: every round pairs them (a round that found nobody would be solo).
        mate = next(n.peer_id for n in swarm.stage(node.stage) if n is not node)
        assert all(r["outcome"] == "paired" and r["partner"] == mate for r in history), (node.peer_id, history)
        assert node.sync.outer_round == steps // every + 1
        # What a node received in its rounds is what its mate sent (a researcher's audit read
        # `recv 0 B` after eight paired rounds: received outer bytes were not counted).
        assert node.sync.bytes_received == next(m for m in swarm.stage(node.stage) if m is not node).sync.bytes_sent > 0
    for node in swarm.stage(1):  # random routing reaches every replica from every sender
        received = node.runtime.stats.forwards_received
        assert set(received) == {"s0r0", "s0r1"} and min(received.values()) > 0, received
    for node in swarm.stage(0):
        losses = node.driver.log.step_losses
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert all(not node.worker.saved and not node.runtime.in_flight for node in swarm.nodes)  # nothing left behind


def test_a_pair_round_leaves_both_replicas_on_the_same_weights(tmp_path):
    """Both replicas start from the same phi with zero momentum, so one lossless pair round gives
    both phi + beta * (mean(theta) - phi), bit for bit: each side computes the mean of the same two
    wire values (own first, a + b == b + a), and no inner step runs during the round."""
    every = 4
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": every,
            "outer.codec": "none",
            "pipeline.num_stages": 2,
            "timeouts.match_s": 3.0,
        },
    )
    swarm = run(config, replicas=2, steps=every)
    for stage in (0, 1):
        a, b = swarm.stage(stage)
        assert a.sync.counters.paired == b.sync.counters.paired == 1
        wa, wb = a.weights(), b.weights()
        assert all(torch.equal(wa[n], wb[n]) for n in wa), stage
        moved = [n for n in wa if not torch.equal(wa[n], a.parts.outer_state.phi[n].to(wa[n].dtype))]
        assert moved == []  # theta <- phi after the round


@pytest.mark.parametrize("rank", [0, 16], ids=["dense", "subspace16"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_exact_pipeline_equals_the_whole_model_in_process(tmp_path, num_stages, rank):
    """With a residual subspace too: its hops carry 16 coordinates per token (hidden 128) and the
    token ids, and the stages still train exactly the whole subspace model."""
    steps = 5
    # On the CPU wherever it runs: the oracle is float32, a GPU stage runs bf16 autocast.
    config = tiny_config(
        tmp_path,
        **{
            "pipeline.num_stages": num_stages,
            "pipeline.deterministic": "true",
            "pipeline.activation_codec": "none",
            "pipeline.device": "cpu",
            "model.residual_subspace": rank,
        },
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        swarm = run(config, replicas=1, steps=steps)
        ref_losses, ref_weights = train_whole_model(config, swarm.corpus, swarm.tokenizer, steps)
    finally:
        torch.set_num_threads(threads)
    assert_accounting(swarm, steps)
    [driver] = swarm.stage(0)
    torch.testing.assert_close(torch.tensor(driver.driver.log.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    seen = set()
    for node in swarm.nodes:
        for name, tensor in node.parts.stage.state_dict().items():
            ref = ref_weights[name]
            rel = float((tensor.double() - ref.double()).norm() / ref.double().norm())
            # A subspace boundary rebuilds h as fixed + (h - fixed) U U^T: float32 rounding at each
            # boundary (exact in float64: tests/unit/model/test_subspace.py), which 5 Adam steps
            # amplify to ~2e-5 on the 3-stage split.
            assert rel <= (1e-5 if not rank else 1e-4), f"stage {node.stage} {name} differs by {rel:.2e} (relative)"
            seen.add(name)
    assert seen == set(ref_weights), "the stages together must hold exactly the whole model"
    cfg = config.pipeline
    values = steps * cfg.batch_size * config.model.seq_len * (rank or config.model.shape()["hidden_size"])
    for node in swarm.nodes[:-1]:  # float32 payloads, counted by the in-memory transport: the
        # forward hop from every stage but the last, and the gradient (as wide) back from stages > 0
        hops = 1 if node.stage == 0 else 2
        assert node.pipeline.runtime.transport.bytes_sent == 4 * values * hops, node.stage


@pytest.mark.parametrize("schedule", ["exact", "overlap"])
def test_schedules_complete_every_microbatch_with_bounded_staleness_in_process(tmp_path, schedule):
    steps = 12
    config = tiny_config(
        tmp_path,
        **{
            "pipeline.schedule": schedule,
            "pipeline.batch_size": 8,
            "pipeline.microbatch_size": 2,
            "pipeline.num_stages": 3,
            "pipeline.activation_codec": "none",
        },
    )
    swarm = run(config, replicas=1, steps=steps)
    assert_accounting(swarm, steps)
    [driver] = swarm.stage(0)
    log = driver.driver.log
    assert driver.driver.overlap == (schedule == "overlap")
    if schedule == "exact":
        assert log.stale_microbatches == 0 and log.max_staleness == 0
    else:
        assert log.max_staleness == 1 and log.stale_microbatches > 0  # bounded, and it really overlapped
    assert sum(log.step_losses[-3:]) / 3 < sum(log.step_losses[:3]) / 3


def dp_config(tmp_path, **extra):
    return tiny_config(
        tmp_path,
        **{
            "outer.method": "dp",
            "outer.allreduce_group_size": 2,
            "pipeline.num_stages": 2,
            "pipeline.batch_size": 6,
            **extra,
        },
    )


def assert_identical_replicas(swarm: InProcessSwarm) -> None:
    for stage in (0, 1):
        weights = [n.weights() for n in swarm.stage(stage)]
        for a, b in itertools.combinations(weights, 2):
            for name in a:
                assert torch.equal(a[name], b[name]), (
                    f"stage {stage} {name}: max diff {(a[name] - b[name]).abs().max()}"
                )


def test_dp_replicas_stay_identical_in_process(tmp_path):
    steps = 6
    swarm = run(dp_config(tmp_path), replicas=2, steps=steps)
    assert_accounting(swarm, steps)
    for node in swarm.nodes:
        history = node.sync.counters.history
        assert [r["outcome"] for r in history] == ["paired"] * steps, (node.peer_id, history)
    assert_identical_replicas(swarm)
    # Lockstep: balanced routing gives every stage-1 replica one share of every batch.
    for node in swarm.stage(0):
        assert node.runtime.stats.routed_balanced == steps * 6 // 2 and node.runtime.stats.routed_random == 0
    losses = swarm.stage(0)[0].driver.log.losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3


def test_a_dp_round_that_fails_for_everyone_is_skipped_by_everyone(tmp_path):
    steps = 4

    def miss_round_2(swarm: InProcessSwarm) -> None:
        swarm.all_reduce[1].wait_s = 0.5
        swarm.all_reduce[1].absent.add(("s1r0", 2))  # s1r0 never joins round 2: it fails for both

    # The round is retried for 3/4 of timeouts.microbatch_s before everyone skips it; 4 s keeps that short.
    swarm = run(dp_config(tmp_path, **{"timeouts.microbatch_s": 4.0}), replicas=2, steps=steps, inject=miss_round_2)
    assert_accounting(swarm, steps)
    for node in swarm.stage(1):
        outcomes = [r["outcome"] for r in node.sync.counters.history]
        assert outcomes == ["paired", "skipped", "paired", "paired"], (node.peer_id, outcomes)
    assert_identical_replicas(swarm)


def test_a_dp_replica_late_for_a_round_is_waited_for_not_skipped(tmp_path):
    """A member that reaches round 2 after the others' attempt timed out (wait 0.5 s, late 1.5 s):
    they try the round again while patience lasts, and it is applied by all. Without that, a replica
    one timeout behind never meets the others again (every later round fails for everyone)."""
    steps = 4

    def late_for_round_2(swarm: InProcessSwarm) -> None:
        swarm.all_reduce[1].wait_s = 0.5
        swarm.all_reduce[1].late[("s1r0", 2)] = 1.5

    swarm = run(dp_config(tmp_path), replicas=2, steps=steps, inject=late_for_round_2)
    assert_accounting(swarm, steps)
    for node in swarm.stage(1):
        assert [r["outcome"] for r in node.sync.counters.history] == ["paired"] * steps, node.peer_id
    assert_identical_replicas(swarm)


def test_dp_replicas_that_came_apart_are_averaged_back_together(tmp_path):
    """A round hivemind delivers in part to one member only: that member skips while the other
    steps, so the two come apart; the next round's fingerprints show it to both, and they average
    their weights and Adam state back into one (the rounds after are normal again)."""
    steps = 5

    def partial_round_2(swarm: InProcessSwarm) -> None:
        swarm.all_reduce[1].partial.add(("s1r1", 2))

    swarm = run(dp_config(tmp_path), replicas=2, steps=steps, inject=partial_round_2)
    assert_accounting(swarm, steps)
    a, b = swarm.stage(1)
    assert [r["outcome"] for r in a.sync.counters.history] == ["paired", "paired", "resynced", "paired", "paired"]
    assert [r["outcome"] for r in b.sync.counters.history] == ["paired", "skipped", "resynced", "paired", "paired"]
    assert a.sync.counters.resynced == b.sync.counters.resynced == 1
    assert_identical_replicas(swarm)
    sa, sb = (n.worker.inner.adam.state for n in (a, b))
    for pa, pb in zip(a.worker.inner.params, b.worker.inner.params):
        assert torch.equal(sa[pa]["exp_avg"], sb[pb]["exp_avg"]) and float(sa[pa]["step"]) == float(sb[pb]["step"])


def test_dp_routes_nothing_while_its_view_of_the_stages_is_short(tmp_path):
    """Replica 1 of both stages drops out of the lookups for a while (their records expired, as on
    a loaded machine). s0r0 then sees one sender and one receiver, a view in which the balanced
    choice is always s1r0; in lockstep it must wait for the whole view instead, or s1r0 gets a
    microbatch that was s1r1's and the stage's replicas step on different batches."""
    steps = 6

    def hide_replica_1_for_a_while(swarm: InProcessSwarm) -> None:
        async def hide() -> None:
            driver = swarm.stage(0)[0]
            while driver.worker.inner_steps < 1:
                await asyncio.sleep(0.005)
            swarm.network.hidden |= {"s0r1", "s1r1"}
            await asyncio.sleep(0.5)
            swarm.network.hidden.clear()

        asyncio.get_running_loop().create_task(hide())

    swarm = run(dp_config(tmp_path), replicas=2, steps=steps, inject=hide_replica_1_for_a_while, timeout_s=60.0)
    assert_accounting(swarm, steps)
    for node in swarm.stage(1):  # every stage-1 replica got exactly its share of every batch
        received = node.runtime.stats.forwards_received
        assert sum(received.values()) == steps * 6 // 2, (node.peer_id, dict(received))
    assert_identical_replicas(swarm)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_dp_replica_left_behind_by_a_group_it_gave_up_on_skips_the_round(tmp_path, stage):
    """hivemind formed round 2's group with s?r0's part while s?r0's own matchmaking reported
    failure: s?r1 gets an incomplete mean and skips round 2; s?r0 sees a short group. It must not
    wait for round 2 for its whole patience (450 s here; the train deadline is 60 s): the stage's
    records show s?r1 past round 2, so s?r0 skips it too, and both stay in lockstep."""
    steps = 4

    def unaware_of_round_2(swarm: InProcessSwarm) -> None:
        swarm.all_reduce[stage].wait_s = 0.5
        swarm.all_reduce[stage].unaware.add((f"s{stage}r0", 2))

    swarm = run(
        dp_config(tmp_path, **{"timeouts.microbatch_s": 600.0}),
        replicas=2,
        steps=steps,
        inject=unaware_of_round_2,
        timeout_s=60.0,
    )
    assert_accounting(swarm, steps)
    behind, ahead = swarm.stage(stage)
    for node in (behind, ahead):
        assert [r["outcome"] for r in node.sync.counters.history] == ["paired", "skipped", "paired", "paired"], (
            node.peer_id
        )
    assert behind.sync.counters.history[1]["left_behind"] and not ahead.sync.counters.history[1]["left_behind"]
    assert not ahead.sync.counters.history[1]["complete"]
    assert_identical_replicas(swarm)


def test_diloco_three_replicas_share_phi_after_every_round_in_process(tmp_path):
    steps, every = 10, 5
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
    swarm = run(config, replicas=3, steps=steps)
    assert_accounting(swarm, steps)
    for stage in (0, 1):
        members = swarm.stage(stage)
        rounds = [h for n in members for h in n.sync.counters.history]
        assert len(rounds) == 3 * steps // every and all(h["group"] == 3 and h["same_round"] for h in rounds), rounds
        for a, b in itertools.combinations(members, 2):
            for name, phi in a.parts.outer_state.phi.items():
                torch.testing.assert_close(phi, b.parts.outer_state.phi[name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_overlapped_outer_exchange_lets_stage0_keep_stepping(tmp_path, overlap):
    """With outer.overlap, stage 0 takes inner steps while its exchange is in flight (slowed here
    to 0.6 s) and the update lands later; blocking, the round is applied at its own boundary.
    Either way both replicas end on the same phi and momentum (two replicas always pair, from the
    same phi_0, and compute the same group mean), with each one's own progress kept on top."""
    steps, every = 12, 4
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": every,
            "outer.overlap": str(overlap).lower(),
            "pipeline.num_stages": 1,
            "timeouts.match_s": 5.0,
            "faults.inject": "during_exchange:delay=0.6",
        },
    )
    swarm = run(config, replicas=2, steps=steps)
    assert_accounting(swarm, steps)
    a, b = swarm.stage(0)
    for node in (a, b):
        history = node.sync.counters.history
        assert [r["outcome"] for r in history] == ["paired"] * (steps // every), history
        lag = [r["applied_at_step"] - r["inner_step"] for r in history]
        assert all(x > 0 for x in lag[:-1]) if overlap else all(x == 0 for x in lag), lag
    for name, phi in a.parts.outer_state.phi.items():
        assert torch.equal(phi, b.parts.outer_state.phi[name]), name
        assert torch.equal(a.parts.outer_state.momentum[name], b.parts.outer_state.momentum[name]), name


def test_a_later_stage_runs_its_overlapped_rounds_one_at_a_time_in_order(tmp_path):
    """A later stage's boundaries run in the background of its gradients, so with a slow exchange
    several can be waiting at once; each round must still start only after the one before it was
    applied (concurrent rounds shared one round's state: seen in the D4 x P2 demo, rounds 4-7 of a
    stage-1 replica ran together and three of them ended with no outcome counted)."""
    steps, every = 12, 2
    config = tiny_config(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": every,
            "outer.overlap": "true",
            "pipeline.num_stages": 2,
            "pipeline.batch_size": 4,
            "timeouts.match_s": 5.0,
            "faults.inject": "during_exchange:delay=0.6",
        },
    )
    swarm = run(config, replicas=2, steps=steps)
    assert_accounting(swarm, steps)
    for node in swarm.stage(1):
        history, counters = node.sync.counters.history, node.sync.counters
        rounds = [r["round"] for r in history]
        assert rounds == list(range(1, len(rounds) + 1)), history
        assert counters.paired + counters.solo == counters.rounds == len(history), vars(counters)
        frozen_at = [r["frozen_at_step"] for r in history]
        applied_at = [r["applied_at_step"] for r in history]
        assert all(r["frozen_at_step"] >= r["inner_step"] for r in history), history
        assert all(applied <= later for applied, later in zip(applied_at, frozen_at[1:])), (frozen_at, applied_at)


def test_dp_forwards_answered_busy_wait_for_their_own_receiver(tmp_path):
    """Stage-1 replicas hold one microbatch at a time (max_in_flight 1), so senders hear BUSY. A dp
    replica steps per batch it received: the sender must retry its balanced receiver, never hand
    the microbatch to the other one (that one would step early, this one would be short, and the
    stage would wait for it in the all-reduce)."""
    steps = 4
    swarm = run(dp_config(tmp_path, **{"pipeline.max_in_flight": 1}), replicas=2, steps=steps)
    assert_accounting(swarm, steps)
    assert sum(n.runtime.stats.busy_answers for n in swarm.stage(1)) > 0
    for node in swarm.stage(0):
        assert node.runtime.stats.routed_random == 0, vars(node.runtime.stats)
    for node in swarm.stage(1):
        assert [r["outcome"] for r in node.sync.counters.history] == ["paired"] * steps, node.peer_id
    assert_identical_replicas(swarm)
