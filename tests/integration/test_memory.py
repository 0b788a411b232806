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


def test_a_stage_that_cannot_fit_is_refused_before_allocating(tmp_path):
    """The paper's large model as one stage needs ~9.6B x 24 bytes of training state alone: `join`
    exits 2 at once with the estimate and the fixes, having allocated none of it."""
    import subprocess
    import sys

    from noloco_node.model.build import run_model
    from noloco_node.model.memory import available_bytes, estimate

    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 1, "model.preset": "large"})
    overrides = [o for o in overrides if not o.startswith(("model.hidden_size", "model.intermediate_size",
                                                            "model.num_layers", "model.num_heads"))]
    config, _, tokenizer = prepare_tokenizer(overrides)
    llama, ranges = run_model(config, len(tokenizer))
    import torch

    need = estimate(llama, ranges[0], first=True, last=True, outer=False, max_in_flight=8, microbatch=2, seq_len=16,
                    checkpointing=False)
    assert need.total > available_bytes(torch.device("cpu")), "this machine could hold it: the check would not fire"
    sets = [a for o in overrides for a in ("--set", o)]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "noloco_node", "join", "--stage", "0", "--initial-peers",
                             "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ", *sets],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs about" in result.stderr and "activation_checkpointing" in result.stderr, result.stderr[-2000:]
    print(f"\nrefused in {time.monotonic() - started:.1f} s: {result.stderr.strip()[-400:]}")
