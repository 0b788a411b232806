"""A tiny 4-cell experiment (NoLoCo and DiLoCo, one stage each so every node holds the whole
model, 2 seeds) end to end through the real console script: the report, the CSVs (one row per
cell with finite losses, one per group with its mean and std over seeds) and every plot exist;
per-node event streams were written."""

import csv
import json
import math
import subprocess
import sys

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_four_cell_experiment_writes_report_csvs_and_plots(tmp_path):
    overrides = dict(o.split("=", 1) for o in tiny_overrides(tmp_path, **{"data.holdout_fraction": 0.1}))
    overrides.pop("outer.method")
    prepare_tokenizer([f"{k}={v}" for k, v in overrides.items()])
    lines = [f'"{k}" = {json.dumps(v)}' for k, v in overrides.items()]
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(
        "\n".join(
            [
                'name = "tiny"',
                'methods = ["noloco", "diloco"]',
                "replicas = [2]",
                "stages = [1]",
                "seeds = [0, 1]",
                "steps = 8",
                "eval_every = 4",
                "eval_sequences = 4",
                "outer_sync_sizes = [2]",
                "outer_sync_numel = 20000",
                "cell_timeout_s = 240",
                "[overrides]",
                *lines,
                '"outer.inner_steps_per_outer" = 4',
                '"timeouts.match_s" = 2.0',
                "[[profiles]]",
                'name = "wan"',
                "one_way_ms = 5",
                "mbit = 200",
                "",
            ]
        )
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "noloco_node", "experiment", str(scenario), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "cell 4/4" in result.stdout  # progress is shown

    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["method"], r["seed"]) for r in rows] == [
        ("noloco", "0"),
        ("noloco", "1"),
        ("diloco", "0"),
        ("diloco", "1"),
    ]
    for row in rows:
        assert row["status"] == "ok"
        assert math.isfinite(float(row["final_val_loss"])) and math.isfinite(float(row["final_train_loss"]))
        assert int(row["final_eval_step"]) == 8  # every node's last snapshot is in: methods compare at the same step
        assert int(row["mb_issued"]) == int(row["mb_completed"]) + int(row["mb_dropped"])
    groups = list(csv.DictReader(open(out / "groups.csv")))
    assert [(g["method"], g["seeds"]) for g in groups] == [("noloco", "2"), ("diloco", "2")]
    for g in groups:
        assert math.isfinite(float(g["val_loss_mean"])) and float(g["val_loss_std"]) >= 0.0
    for name in (
        "report.md",
        "scenario.json",
        "link_check.json",
        "groups.csv",
        "outer_sync.csv",
        "validation_loss.png",
        "outer_sync_vs_n.png",
        "bytes_per_node.png",
        "spread_vs_lr.png",
        "idle_time.png",
    ):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "Reproduce: `noloco-node experiment" in report and "## Verdicts" in report
    assert "Validation loss at step 8: noloco" in report and "(SE)" in report  # a verdict with its uncertainty
    link = json.loads((out / "link_check.json").read_text())[0]
    assert link["rtt_ms"] >= 10.0  # the relay's 2 x 5 ms are really there
    for row in rows:
        events = list((out / "cells" / row["cell"] / "events").glob("*.jsonl"))
        assert len(events) == 2
