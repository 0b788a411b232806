"""A replica of stage 1 that hangs (SIGSTOP: its kernel still takes the bytes, nothing answers)
costs stage 0 seconds, not the pipeline: a Forward that got all its bytes out and no reply is cut
`stall_s` (plus what may still be buffered) after its last message, and the microbatch goes to the
other replica. A soak saw the whole swarm stop for the full send deadline (30 s) while a second
stage-1 replica served, every microbatch waiting on the frozen one."""

import json
import os
import signal
import time

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
FREEZE_S, STALL_S = 20.0, 2.0


def inner_step(node) -> int:
    return json.loads(node.ready_file.read_text())["inner_step"]


def test_stage0_trains_on_through_a_frozen_stage1_replica(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "inner.total_steps": 100_000,
            "timeouts.rpc_s": 30.0,  # the default send deadline, which the frozen replica used up
            "timeouts.stall_s": STALL_S,
            "timeouts.microbatch_s": 60.0,
            "timeouts.record_ttl_s": 30.0,  # the frozen replica stays listed the whole time
            "faults.compute_delay_s": 0.02,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    frozen, live = (swarm.start_node(1, r) for r in range(2))
    swarm.wait_ready([frozen, live])
    driver = swarm.start_node(0, 0, "--steps", "100000")
    swarm.wait_ready([driver])
    deadline = time.monotonic() + 60
    while inner_step(driver) < 10:
        assert time.monotonic() < deadline and driver.proc.poll() is None, "stage 0 did not start training"
        time.sleep(0.2)

    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        began, last_step, last_change, longest = time.monotonic(), inner_step(driver), time.monotonic(), 0.0
        first_step = last_step
        while time.monotonic() - began < FREEZE_S:
            time.sleep(0.1)
            step = inner_step(driver)
            if step != last_step:
                longest = max(longest, time.monotonic() - last_change)
                last_step, last_change = step, time.monotonic()
        longest = max(longest, time.monotonic() - last_change)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    print(f"\nlongest stage-0 pause while a stage-1 replica was frozen: {longest:.1f} s")
    log = driver.log_file.read_text(errors="replace")
    assert longest < FREEZE_S - 5, f"stage 0 stopped for {longest:.1f} s of a {FREEZE_S:.0f} s freeze\n{log[-3000:]}"
    assert last_step > first_step + 5, (first_step, last_step)
    assert "a node serving stage 1 fixes it" not in log, log[-3000:]
