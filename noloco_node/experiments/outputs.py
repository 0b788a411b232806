"""What an experiment writes into its folder: results.csv, curves.json, groups.csv, outer_sync.csv,
the plots and report.md from the measured cells; and the folder itself, refused where it would
mix a new run with an earlier one."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path

from noloco_node.config import ConfigError
from noloco_node.experiments import plots
from noloco_node.experiments.aggregate import summarize_groups
from noloco_node.experiments.report import write_report
from noloco_node.experiments.scenario import Scenario
from noloco_node.experiments.verdicts import sync_summary

FIGURES = {
    "validation_loss": "validation_loss.png",
    "outer_sync": "outer_sync_vs_n.png",
    "bytes": "bytes_per_node.png",
    "spread": "spread_vs_lr.png",
    "idle": "idle_time.png",
}
STAT_FIELDS = [
    "val_loss",
    "val_loss_equal_time",
    "train_wall_s",
    "spread",
    "peak_spread",
    "pearson",
    "bytes_per_node",
    "pipeline_bytes_per_node",
    "outer_bytes_per_round",
    "outer_lag_steps",
    "delta_rel_error",
    "idle",
]
GROUP_FIELDS = ["group", "method", "variant", "replicas", "stages", "profile", "seeds", "eval_step", "equal_time_s"] + [
    f"{k}_{s}" for k in STAT_FIELDS for s in ("mean", "std")
]
# What a run writes into its folder; --overwrite removes these (and only these) first.
RUN_FILES = (
    "cells",
    "outer_sync",
    "scenario.json",
    "link_check.json",
    "results.csv",
    "groups.csv",
    "outer_sync.csv",
    "curves.json",
    "report.md",
    *FIGURES.values(),
)
SYNC_FIELDS = ["method", "profile", "n", "repeat", "median_s", "max_s", "mb_per_node", "paired", "solo"]
ROW_FIELDS = [
    "cell",
    "group",
    "variant",
    "method",
    "replicas",
    "stages",
    "profile",
    "seed",
    "status",
    "steps",
    "final_val_loss",
    "final_eval_step",
    "final_train_loss",
    "wall_s",
    "train_wall_s",
    "bytes_per_node",
    "idle_fraction",
    "final_spread",
    "spread_lr_pearson",
    "outer_rounds",
    "outer_paired",
    "outer_solo",
    "outer_partial",
    "outer_skipped",
    "outer_resynced",
    "outer_lag_steps",
    "nodes_short",
    "pipeline_bytes_per_node",
    "outer_bytes_per_round",
    "delta_rel_error",
    "mb_issued",
    "mb_completed",
    "mb_reissued",
    "mb_dropped",
    "error",
]


def prepare_out(out: Path, *, overwrite: bool) -> None:
    """The output folder: refused if it is a file, unwritable, or holds an earlier run (unless
    `overwrite`, which removes that run's files first: no earlier cell is left among the new)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file", "pass a folder (it is created)")
    if (out / "scenario.json").exists():
        if not overwrite:
            raise ConfigError(
                "--out",
                f"{out} holds an earlier run (its scenario.json)",
                "pass a new folder, or --overwrite to replace it",
            )
        for name in RUN_FILES:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".noloco-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            "--out", f"cannot write to {out} ({exc.strerror})", "pass a folder you can write to"
        ) from None


def write_tables(out: Path, cells: list[dict]) -> None:
    """results.csv and curves.json of the cells so far."""
    _write_csv(out / "results.csv", [c["row"] for c in cells], ROW_FIELDS)
    curves = [{"cell": c["row"]["cell"], "evals": c["evals"], "train": c["train"]} for c in cells]
    (out / "curves.json").write_text(json.dumps(_nan_to_none(curves), allow_nan=False))


def _nan_to_none(value):
    """JSON has no NaN: a value not measured is null, so strict parsers read the file too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def write_outputs(
    out: Path,
    scenario: Scenario,
    cells: list[dict],
    sync_rows: list[dict],
    links: list[dict],
    *,
    command: str,
    elapsed_s: float,
    notes: tuple[str, ...] = (),
    stopped: str = "",
) -> list[dict]:
    """results.csv, curves.json, groups.csv, outer_sync.csv, the plots and report.md from measured
    cells (`notes`: what was re-run and why; `stopped`: why the run ended early); returns the groups."""
    write_tables(out, cells)
    groups = summarize_groups(cells)
    _write_csv(out / "groups.csv", [_group_csv_row(g) for g in groups], GROUP_FIELDS)
    _write_csv(out / "outer_sync.csv", sync_rows, SYNC_FIELDS)
    figures = []
    if groups:
        plots.validation_loss(groups, cells, out / FIGURES["validation_loss"])
        plots.spread_vs_lr(groups, out / FIGURES["spread"])
        plots.group_bars(
            groups,
            "bytes_per_node",
            "MB sent per node (data plane + outer)",
            "bytes sent per node",
            out / FIGURES["bytes"],
            1e-6,
        )
        plots.group_bars(
            groups,
            "idle",
            "share of wall time\nthe compute thread waited",
            "idle time (waiting for the network or another stage)",
            out / FIGURES["idle"],
        )
        figures += [FIGURES[k] for k in ("validation_loss", "spread", "bytes", "idle")]
    if sync_rows:
        plots.outer_sync(sync_summary(sync_rows), out / FIGURES["outer_sync"])
        figures.append(FIGURES["outer_sync"])
    write_report(
        out,
        scenario,
        cells,
        groups,
        sync_rows,
        links,
        command=command,
        machine=machine_description(),
        elapsed_s=elapsed_s,
        figures=figures,
        notes=notes,
        stopped=stopped,
    )
    return groups


def _group_csv_row(group: dict) -> dict:
    row = {
        k: group[k]
        for k in ("group", "method", "variant", "replicas", "stages", "profile", "seeds", "eval_step", "equal_time_s")
    }
    for key in STAT_FIELDS:
        row[f"{key}_mean"], row[f"{key}_std"] = group[key].mean, group[key].std
    return row


def machine_description() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        torch_version = torch.__version__
    except ImportError:
        gpu, torch_version = "no GPU", "?"
    return (
        f"{os.cpu_count()} cores ({model}), {gpu}, {platform.system()} {platform.release()}, "
        f"Python {sys.version.split()[0]}, torch {torch_version}"
    )


def _write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def _csv_value(value):
    """Floats to 6 significant digits; a value not measured (NaN) is an empty field."""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
