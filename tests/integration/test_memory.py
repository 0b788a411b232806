"""1,000 microbatches through a 2-stage swarm: afterwards no saved input is left on either
stage, and the resident memory of each node grows by less than RSS_GROWTH_BOUND_MB between the
end of warm-up (microbatch 200) and the end."""

import json
import time

import pytest

from noloco_node.runtime.memory import rss_mb

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

MICROBATCHES, PER_STEP, WARMUP_STEPS = 1000, 8, 25
RSS_GROWTH_BOUND_MB = 16.0



def test_thousand_microbatches_leave_no_saved_inputs_and_bounded_rss(tmp_path, make_swarm):
    overrides = tiny_overrides(tmp_path, **{"run.run_id": "memory-test", "pipeline.batch_size": PER_STEP,
                                            "pipeline.microbatch_size": 1, "inner.total_steps": 200})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    last = swarm.start_node(1, 0)
    swarm.wait_ready([last])
    first = swarm.start_node(0, 0, "--steps", str(MICROBATCHES // PER_STEP))
    swarm.wait_ready([first])
    nodes = (first, last)

    deadline = time.monotonic() + 300
    while json.loads(first.ready_file.read_text())["inner_step"] < WARMUP_STEPS:
        assert time.monotonic() < deadline and first.proc.poll() is None, "stage 0 stopped before warm-up ended"
        time.sleep(0.05)
    warm = {n.label: rss_mb(n.proc.pid) for n in nodes}
    peak = dict(warm)
    while first.proc.poll() is None:
        assert time.monotonic() < deadline, "1,000 microbatches did not finish in time"
        for n in nodes:
            rss = rss_mb(n.proc.pid)
            if rss is not None:  # None: it exited after the loop's check
                peak[n.label] = max(peak[n.label], rss)
        time.sleep(0.2)
    assert first.proc.returncode == 0
    final_last = json.loads(last.ready_file.read_text())
    assert final_last["saved_inputs"] == 0 and final_last["in_flight"] == []
    swarm.stop()

    stats = swarm.node_stats()
    driver = stats[first.info["peer_id"]]
    assert driver["microbatches"]["completed"] == MICROBATCHES and driver["microbatches"]["dropped"] == 0
    assert stats[last.info["peer_id"]]["forwards_received"] and stats[last.info["peer_id"]]["saved_inputs"] == 0
    assert driver["saved_inputs"] == 0
    growth = {label: peak[label] - warm[label] for label in warm}
    print(f"RSS after warm-up {warm} MB, peak after {peak} MB, growth {growth} MB")
    assert all(g < RSS_GROWTH_BOUND_MB for g in growth.values()), growth
