"""End to end through the real CLI: `noloco-node demo` with D=4 replicas x P=2 stages and NoLoCo."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def _log_tails(logs: Path, lines: int = 15) -> str:
    tails = (
        [
            f"\n--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in sorted(logs.glob("*.log"))
        ]
        if logs.exists()
        else []
    )
    return "".join(tails)


def test_demo_noloco_d4_p2(tmp_path):
    sets = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 5,
            "inner.total_steps": 20,
            "timeouts.match_s": 3.0,
        },
    )
    args = [a for s in sets for a in ("--set", s)]
    out = tmp_path / "demo"
    # The demo's own --timeout fires first, so a stall fails with the nodes' logs, not a bare kill.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "noloco_node",
            "demo",
            "--replicas",
            "4",
            "--stages",
            "2",
            "--steps",
            "20",
            "--method",
            "noloco",
            "--timeout",
            "300",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert result.returncode == 0, result.stderr[-3000:] + _log_tails(out / "logs")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "noloco" and summary["replicas"] == 4 and summary["stages"] == 2
    assert summary["inner_steps"] == 20
    assert summary["loss_last"] < summary["loss_first"] - 0.5
    mb = summary["microbatches"]
    assert mb["issued"] == mb["completed"] + mb["dropped"] and mb["dropped"] == 0
    # What it printed: where it is while the nodes start, then the summary in words, no dicts.
    said = result.stdout
    assert said.startswith("starting a local swarm on 127.0.0.1: a bootstrap peer and 4 replicas x 2 stages"), said
    assert "the swarm is up after " in said and "training 20 inner steps" in said
    assert f"microbatches: {mb['issued']:,} issued, {mb['completed']:,} completed" in said
    assert f"outer rounds: {summary['outer']['rounds']}, {summary['outer']['paired']} paired" in said
    assert "{" not in said, said
    outer = summary["outer"]
    nodes = summary["nodes"]
    # Stage-0 replicas step exactly once per batch: 4 rounds each. Stage-1 replicas step per B
    # sequences received, so their counts follow how routing shared the work: capacity routing
    # (the default) gives a replica measured faster more, but starves none. Together they stepped
    # once per B of the 4 x 20 batches, less at most one partial batch each; a microbatch the driver
    # gave up on and reissued may have been computed at two replicas (B = 2 microbatches).
    rounds = [nodes[f"stage0/replica{r}"]["outer"]["rounds"] for r in range(4)]
    assert rounds == [4, 4, 4, 4], f"{rounds}\n{_log_tails(out / 'logs')}"
    stage1_steps = [nodes[f"stage1/replica{r}"]["inner_steps"] for r in range(4)]
    most = 80 + (mb["reissued"] + 1) // 2
    assert 77 <= sum(stage1_steps) <= most and min(stage1_steps) >= 8, (stage1_steps, mb)
    assert outer["paired"] > 0 and outer["paired"] + outer["solo"] == outer["rounds"]
    spread = summary["replica_spread_last"]
    assert spread is not None and 0 < spread < 1.0
    # Every node that paired sent its snapshot. (Without a barrier a replica can run a round
    # ahead of the others and step solo every time: a CI run under load saw 2 of 8 do so.)
    assert all(summary["bytes_sent_outer"][name] > 0 for name, node in nodes.items() if node["outer"]["paired"] > 0)
    assert sum(b > 0 for b in summary["bytes_sent_outer"].values()) >= 4
    # The model at the end: a Hugging Face directory of the trained weights, and the run's config to
    # name it with (an audit's demo left nothing `export` could read).
    model, config_file = out / "model", out / "config.toml"
    assert summary["model"] == str(model) and (model / "config.json").is_file()
    assert f"the trained model (a Hugging Face model directory): {model}" in said
    held_out = subprocess.run(
        [sys.executable, "-m", "noloco_node", "eval", "--config", str(config_file), str(model), "--sequences", "8"]
        + ["--json", "--set", "data.holdout_fraction=0.05"],  # the tiny test config trains on all of its data
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert held_out.returncode == 0, held_out.stderr[-2000:]
    assert json.loads(held_out.stdout)["loss"] < summary["loss_first"] - 0.5, held_out.stdout
