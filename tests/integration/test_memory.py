"""1,000 microbatches through a 2-stage swarm: afterwards no saved input is left on either
stage, and the resident memory of each node grows by less than RSS_GROWTH_BOUND_MB between the
end of warm-up (microbatch 200) and the end. The memory estimate (model/memory.py) against the peak
RSS a stage really reaches (benchmarks/memory_estimate.py, one fresh process per case), and the
node's check: a stage that does not fit is refused before anything is allocated, one that fits
starts."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco_node.runtime.memory import rss_mb

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

MICROBATCHES, PER_STEP, WARMUP_STEPS = 1000, 8, 25
RSS_GROWTH_BOUND_MB = 16.0


def test_thousand_microbatches_leave_no_saved_inputs_and_bounded_rss(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "run.run_id": "memory-test",
            "pipeline.batch_size": PER_STEP,
            "pipeline.microbatch_size": 1,
            "inner.total_steps": 200,
        },
    )
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
    from noloco_node.model.memory import available_bytes, estimate_for_run

    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 1, "model.preset": "large"})
    overrides = [
        o
        for o in overrides
        if not o.startswith(("model.hidden_size", "model.intermediate_size", "model.num_layers", "model.num_heads"))
    ]
    config, _, tokenizer = prepare_tokenizer(overrides)
    llama, ranges = run_model(config, len(tokenizer))
    import torch

    need = estimate_for_run(config, llama, ranges, 0, "cpu")
    assert need.total > available_bytes(torch.device("cpu")), "this machine could hold it: the check would not fire"
    sets = [a for o in overrides for a in ("--set", o)]
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "noloco_node",
            "join",
            "--stage",
            "0",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ",
            *sets,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs about" in result.stderr and "activation_checkpointing" in result.stderr, result.stderr[-2000:]
    print(f"\nrefused in {time.monotonic() - started:.1f} s: {result.stderr.strip()[-400:]}")


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_estimate.py"


def _measure(case: str, *args: str) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--case",
            case,
            "--json",
            "--seq-len",
            "256",
            "--micro",
            "2",
            "--batch",
            "4",
            "--steps",
            "3",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# `small` (hidden 768, 12 layers) as three stages and as one: every role (kept graphs and weight
# stashes on stage 0, recompute in the middle, logits on the last) under both schedules where they differ.
# One of each kind of stage: the first under overlap (kept graphs, two stashes), the last, and the whole model.
SMALL_CASES = ["small:3:0:overlap", "small:3:2:exact", "small:1:0:exact"]


@pytest.mark.parametrize("case", SMALL_CASES)
def test_the_estimate_is_within_25_percent_above_the_measured_peak_rss(case):
    r = _measure(case)
    ratio = r["estimate"] / r["peak"]
    print(
        f"\n{case}: estimate {r['estimate'] / 2**20:.0f} MiB, measured peak RSS {r['peak'] / 2**20:.0f} MiB "
        f"(build {r['build_peak'] / 2**20:.0f}), ratio {ratio:.2f}"
    )
    # Never short by more than the allocator's run-to-run noise, which the start-up check's 10%
    # headroom covers (model/memory.check_fits): a stage that passes it fits. The same code's
    # small:3:2 peaked at 2109 MiB here and at 2233 MiB in a loaded CI run, against an estimate of
    # 2220 (ratio 0.994).
    assert ratio >= 0.97, r["parts"]
    # glibc keeps phi and m's first blocks in the main thread's arena (the estimate's heap_retained)
    # in some runs only: the same code's small:1:0 peak measured 4.63-5.66 GiB over six runs, in two
    # modes 0.95 GiB apart (heap_retained: 0.89 GiB). The estimate holds them; the 25% band is for the rest.
    assert r["estimate"] - r["parts"]["heap_retained"] <= 1.25 * r["peak"], r["parts"]


@pytest.mark.parametrize("case", ["tiny:3:0:overlap", "tiny:1:0:exact"])
def test_tiny_stages_are_estimated_within_the_allocators_noise(case):
    """`tiny` holds 20-50 MiB of state; glibc's heap alone moves its peak RSS by +-20 MiB from run to
    run (the same case measured 101 and 129 MiB), more than a 25 % band: here the estimate only has
    to land within [0.75, 1.5] of the measurement."""
    r = _measure(case)
    ratio = r["estimate"] / r["peak"]
    print(
        f"\n{case}: estimate {r['estimate'] / 2**20:.0f} MiB, measured {r['peak'] / 2**20:.0f} MiB, ratio {ratio:.2f}"
    )
    assert 0.75 <= ratio <= 1.5, r["parts"]


def test_a_stage_that_fits_starts(tmp_path, make_swarm):
    """`small` as two stages: the node checks its stage against this machine's free memory and starts."""
    from noloco_node.model.build import run_model
    from noloco_node.model.memory import available_bytes, estimate_for_run

    overrides = [
        o
        for o in tiny_overrides(tmp_path, **{"pipeline.num_stages": 2, "model.preset": "small"})
        if not o.startswith(("model.hidden_size", "model.intermediate_size", "model.num_layers", "model.num_heads"))
    ]
    config, _, tokenizer = prepare_tokenizer(overrides)
    llama, ranges = run_model(config, len(tokenizer))
    import torch

    need = estimate_for_run(config, llama, ranges, 1, "cpu")
    assert llama.hidden_size == 768 and need.total < 0.9 * available_bytes(torch.device("cpu"))
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    assert node.proc.poll() is None
    swarm.stop()
