"""A stage-1 replica killed with SIGKILL mid-run: the survivor finishes, lost work is re-issued.
(D=2 x P=2 training, routing that mixes replicas and balanced counters run in process in the fast
tier: tests/unit/node/test_swarm_in_process.py; and as processes through `demo` in test_demo_noloco.)"""

import json
import time

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_sigkill_of_a_stage1_replica_is_survived(tmp_path, make_swarm):
    steps = 20
    overrides = tiny_overrides(
        tmp_path, **{"pipeline.batch_size": 8, "inner.total_steps": steps, "timeouts.microbatch_s": 2.0}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    # The victim sits on every forward far longer than the microbatch timeout, so whatever it
    # holds when it dies can only finish through a re-issue.
    victim = swarm.start_node(1, 0, "--set", "faults.delay_before_forward_s=60")
    survivor = swarm.start_node(1, 1)
    swarm.wait_ready([victim, survivor])
    driver = swarm.start_node(0, 0, "--steps", str(steps), "--wait-replicas", "1")
    swarm.wait_ready([driver])
    # Kill it once it holds microbatches it accepted (`served` counts accepted forwards, none of
    # which it releases within 60 s) half a second ago: their Forward calls have returned, so the
    # driver can only get them back by re-issuing (a kill during a Forward call is a failed send,
    # retried elsewhere within the same attempt).
    deadline = time.monotonic() + 120
    accepted: set[int] = set()
    while True:
        assert time.monotonic() < deadline and driver.proc.poll() is None, "victim never held a microbatch"
        status = json.loads(victim.ready_file.read_text())
        held_now = {sequence for _, sequence, _ in status["in_flight"]}
        if (
            held_now
            and status["served"] == len(held_now)
            and json.loads(driver.ready_file.read_text())["inner_step"] >= 2
        ):
            if accepted & held_now:
                break
            accepted = held_now
            time.sleep(0.5)
        else:
            time.sleep(0.02)
    swarm.kill(victim)
    held = accepted & held_now
    swarm.wait_exit([driver], timeout_s=200)
    assert driver.proc.returncode == 0, driver.log_file.read_text()[-3000:]
    swarm.stop()

    stats = swarm.node_stats()
    [stage0] = [s for s in stats.values() if s["stage"] == 0]
    mb = stage0["microbatches"]
    assert stage0["inner_steps"] == steps
    assert mb["issued"] == mb["completed"] + mb["dropped"] == steps * 4 and mb["dropped"] == 0
    assert held and held <= set(stage0["reissued_sequences"]), (held, stage0["reissued_sequences"])
    assert mb["reissued"] == len(stage0["reissued_sequences"]) >= len(held)
    assert stats[survivor.info["peer_id"]]["sequences"] > 0
    assert victim.info["peer_id"] not in stats  # killed: it never wrote stats
