"""`noloco-node experiment`: measure each network profile through the relay, run every cell of the
grid (a failed cell is recorded, never hidden), group the cells over seeds, measure one outer
round vs N per method and profile, and write scenario.json, link_check.json, results.csv,
groups.csv, outer_sync.csv, PNG plots and report.md into one output folder."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

from noloco_node.experiments import plots
from noloco_node.experiments.aggregate import summarize_groups
from noloco_node.experiments.cell import run_cell
from noloco_node.experiments.outer_rounds import run_round
from noloco_node.experiments.report import sync_summary, write_report
from noloco_node.experiments.scenario import Scenario
from noloco_node.netem.selfcheck import measure_link

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
    "pipeline_bytes_per_node",
    "outer_bytes_per_round",
    "delta_rel_error",
    "mb_issued",
    "mb_completed",
    "mb_reissued",
    "mb_dropped",
    "error",
]


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_experiment(scenario: Scenario, out: Path, command: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(scenario.to_dict(), indent=1))
    started = time.time()
    links = []
    for profile in scenario.profiles:
        link = asyncio.run(measure_link(profile))
        links.append(link)
        say(
            f"link {profile.name}: RTT {link['rtt_ms']:.1f} ms (profile {2 * profile.one_way_ms:.0f}), "
            f"{link['mbit']:.1f} Mbit/s (profile {profile.mbit or 'unlimited'})"
        )
    (out / "link_check.json").write_text(json.dumps(links, indent=1))

    cells, grid = [], scenario.cells()
    for i, cell in enumerate(grid, 1):
        say(f"cell {i}/{len(grid)} {cell.name}: running")
        t = time.monotonic()
        try:
            result = run_cell(scenario, cell, out / "cells" / cell.name)
        except Exception as exc:  # noqa: BLE001 - a failed cell is reported in the results, not raised
            (out / "cells" / cell.name).mkdir(parents=True, exist_ok=True)
            (out / "cells" / cell.name / "error.txt").write_text(traceback.format_exc())
            result = {
                "row": {
                    "cell": cell.name,
                    "group": cell.group,
                    "variant": cell.variant.name if cell.variant else "",
                    "method": cell.method,
                    "replicas": cell.replicas,
                    "stages": cell.stages,
                    "profile": cell.profile.name,
                    "seed": cell.seed,
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {exc}"[:300],
                },
                "evals": [],
                "train": [],
            }
        cells.append(result)
        row = result["row"]
        say(
            f"cell {i}/{len(grid)} {cell.name}: {row['status']} in {time.monotonic() - t:.0f} s"
            + (f", val loss {row['final_val_loss']:.3f}" if row["status"] == "ok" else f" ({row['error']})")
        )
    sync_rows = outer_sync_rows(scenario, out / "outer_sync")
    groups = write_outputs(out, scenario, cells, sync_rows, links, command=command, elapsed_s=time.time() - started)
    say(f"done in {time.time() - started:.0f} s: {out / 'report.md'}")
    return {"cells": [c["row"] for c in cells], "groups": groups, "outer_sync": sync_rows, "links": links}


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
) -> list[dict]:
    """results.csv, curves.json, groups.csv, outer_sync.csv, the plots and report.md from measured
    cells (`notes`: what was re-run and why, for the report); returns the groups."""
    _write_csv(out / "results.csv", [c["row"] for c in cells], ROW_FIELDS)
    (out / "curves.json").write_text(
        json.dumps([{"cell": c["row"]["cell"], "evals": c["evals"], "train": c["train"]} for c in cells])
    )
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
            "share of wall time the compute thread waited",
            "idle time (waiting on the network)",
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


def outer_sync_rows(scenario: Scenario, work: Path) -> list[dict]:
    rows = []
    for profile in scenario.profiles:
        for n in scenario.outer_sync_sizes:
            for repeat in range(scenario.outer_sync_repeats):
                for method in scenario.sync_methods():
                    say(
                        f"outer sync: {method} N={n} over {profile.name} (round "
                        f"{repeat + 1}/{scenario.outer_sync_repeats})"
                    )
                    row = {"method": method, "profile": profile.name, "n": n, "repeat": repeat}
                    try:
                        results = run_round(
                            method,
                            n,
                            work / f"{method}-{profile.name}-{n}-{repeat}",
                            numel=scenario.outer_sync_numel,
                            codec=scenario.outer_sync_codec,
                            profile=profile,
                            match_s=10.0 + 4 * profile.one_way_ms / 1e3 * n,
                        )
                    except Exception as exc:  # noqa: BLE001 - recorded, the report says which N failed
                        say(f"outer sync {method} N={n} failed: {exc}"[:300])
                        rows.append(
                            row
                            | {"median_s": math.nan, "max_s": math.nan, "mb_per_node": math.nan, "paired": 0, "solo": 0}
                        )
                        continue
                    seconds = [r["history"][0]["seconds"] for r in results]
                    rows.append(
                        row
                        | {
                            "median_s": statistics.median(seconds),
                            "max_s": max(seconds),
                            "mb_per_node": statistics.fmean(r["bytes_sent"] for r in results) / 1e6,
                            "paired": sum(r["outcome"] == "paired" for r in results),
                            "solo": sum(r["outcome"] == "solo" for r in results),
                        }
                    )
    return rows


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
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
