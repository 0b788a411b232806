"""A replica left rounds behind its stage while it runs (a laptop asleep, a process stopped) copies
its stage's state again and pairs, instead of going solo for the rest of the run."""

import json
import os
import signal
import time

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
# The pause must leave it further behind than its solo rounds catch up: the replica that ran on
# waits timeouts.match_s for a partner every round, so it gains only about a step a second, and the
# stopped one, back, runs its rounds without waiting. With 16 s a clean-clone CI run saw the two
# level again at the fourth round after the pause, paired, and no copy was needed (or made).
H, STEPS, PAUSE_S = 4, 2000, 30.0


def status(node) -> dict:
    return json.loads(node.ready_file.read_text())


def wait_for(node, done, *alive, within_s: float) -> dict:
    """`node`'s ready file once `done` holds for it (every process in `alive` still running)."""
    deadline = time.monotonic() + within_s
    while not done(now := status(node)):
        assert time.monotonic() < deadline, now
        assert all(n.proc.poll() is None for n in (node, *alive)), "a node exited"
        time.sleep(0.2)
    return now


def paired_since_it_came_back(node) -> int:
    _, moved, after = node.log_file.read_text(errors="replace").partition("moved to stage")
    return after.count("paired with") if moved else 0


def test_a_replica_stopped_for_many_rounds_copies_its_stage_again_and_pairs(tmp_path, make_swarm):
    """Two stage-0 replicas train with H = 4; one is stopped (SIGSTOP) for 30 s, rounds past the 2
    the catch-up waits for. Continued, its rounds go solo ("replicas ahead") until it leaves its
    stage, copies the other's state (not its own, older checkpoint) and comes back level: it pairs
    again."""
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": H,
            "inner.total_steps": STEPS,
            "timeouts.match_s": 3.0,
            "faults.compute_delay_s": 0.03,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    later = swarm.start_node(1, 0)
    swarm.wait_ready([later])
    ahead, behind = (swarm.start_node(0, r, "--steps", str(STEPS)) for r in range(2))
    swarm.wait_ready([ahead, behind])
    wait_for(behind, lambda s: s["inner_step"] >= 3 * H, ahead, within_s=60)
    os.kill(behind.proc.pid, signal.SIGSTOP)
    try:
        stopped_at = status(behind)["inner_step"]
        time.sleep(PAUSE_S)
    finally:
        os.kill(behind.proc.pid, signal.SIGCONT)
    gap = status(ahead)["inner_step"] - stopped_at
    wait_for(behind, lambda s: paired_since_it_came_back(behind) >= 2, ahead, within_s=150)
    swarm.stop()

    stats = swarm.node_stats()
    mine = stats[behind.info["peer_id"]]
    rounds = [(r["outcome"], r.get("reason")) for r in mine["outer_history"]]
    print(f"\ngap {gap} steps; moves {mine['moves']}\nfetched {mine['fetched_state']}\nrounds since {rounds}")
    assert gap > 2 * H, f"the pause left it only {gap} steps behind, within the catch-up's reach"
    assert [m.get("why") for m in mine["moves"]] == ["behind"], mine["moves"]
    fetched = mine["fetched_state"]
    assert fetched is not None and fetched["donor"] == ahead.info["peer_id"], fetched
    assert fetched["inner_step"] >= mine["moves"][0]["inner_step"] + H, (fetched, mine["moves"])
    assert sum(outcome == "paired" for outcome, _ in rounds) >= 2, rounds
