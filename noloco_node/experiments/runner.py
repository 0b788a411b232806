"""`noloco-node experiment`: measure each network profile through the relay, run every cell of the
grid (a failed cell is recorded, never hidden), group the cells over seeds, measure one outer
round vs N per method and profile, and write scenario.json, link_check.json, results.csv,
groups.csv, outer_sync.csv, PNG plots and report.md into one output folder."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
import traceback
from pathlib import Path

from noloco_node.config import ConfigError, load_config
from noloco_node.experiments.cell import cell_overrides, run_cell
from noloco_node.experiments.outer_rounds import run_round
from noloco_node.experiments.outputs import prepare_out, write_outputs, write_tables
from noloco_node.experiments.process_group import Interrupted
from noloco_node.experiments.scenario import Scenario
from noloco_node.netem.selfcheck import measure_link


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_experiment(scenario: Scenario, out: Path, command: str, *, overwrite: bool = False) -> dict:
    """Run the grid into `out`. After every cell results.csv and curves.json hold the cells so far;
    a stop signal (Interrupted) writes the tables, plots and report of the finished cells, then
    goes on up."""
    check_cell_configs(scenario)
    prepare_out(out, overwrite=overwrite)
    (out / "scenario.json").write_text(json.dumps(scenario.to_dict(), indent=1))
    started = time.time()
    links, cells, sync_rows, grid = [], [], [], scenario.cells()
    try:
        for profile in scenario.profiles:
            links.append(_checked_link(profile))
        (out / "link_check.json").write_text(json.dumps(links, indent=1))
        for i, cell in enumerate(grid, 1):
            cells.append(_run_one(scenario, cell, out, f"{i}/{len(grid)}"))
            write_tables(out, cells)
        outer_sync_rows(scenario, out / "outer_sync", sync_rows)
    except Interrupted as stop:
        if cells:
            stopped = (
                f"stopped by {stop} after {len(cells)} of {len(grid)} cells"
                + ("" if len(cells) < len(grid) else ", in the outer-sync measurement")
                + ": the tables, plots and verdicts cover what finished"
            )
            write_outputs(
                out,
                scenario,
                cells,
                sync_rows,
                links,
                command=command,
                elapsed_s=time.time() - started,
                stopped=stopped,
            )
            say(f"{stopped}: {out / 'report.md'}")
        raise
    groups = write_outputs(out, scenario, cells, sync_rows, links, command=command, elapsed_s=time.time() - started)
    say(f"done in {time.time() - started:.0f} s: {out / 'report.md'}")
    return {"cells": [c["row"] for c in cells], "groups": groups, "outer_sync": sync_rows, "links": links}


def check_cell_configs(scenario: Scenario) -> None:
    """Every cell's node config, before any link is measured or node started: a typo in
    [overrides] or a variant fails here once, named, instead of in every cell."""
    for cell in {cell.group: cell for cell in scenario.cells()}.values():  # seeds change no field's validity
        try:
            load_config(overrides=cell_overrides(scenario, cell))
        except ConfigError as exc:
            variant = cell.variant and any(exc.field.startswith(k) for k, _ in cell.variant.overrides)
            where = f"[[variants]] {cell.variant.name!r}" if variant else "[overrides]"
            raise ConfigError(exc.field, f"{exc.problem} (the scenario's {where}, cell {cell.name})", exc.fix) from None


def _checked_link(profile) -> dict:
    link = asyncio.run(measure_link(profile))
    say(
        f"link {profile.name}: RTT {link['rtt_ms']:.1f} ms (profile {2 * profile.one_way_ms:.0f}"
        + (f" ± {2 * profile.jitter_ms:.0f} jitter" if profile.jitter_ms else "")
        + f"), {link['mbit']:.1f} Mbit/s (profile {profile.mbit or 'unlimited'})"
    )
    return link


def _run_one(scenario: Scenario, cell, out: Path, position: str) -> dict:
    say(f"cell {position} {cell.name}: running")
    t = time.monotonic()
    try:
        result = run_cell(scenario, cell, out / "cells" / cell.name)
    except Exception as exc:  # noqa: BLE001 - a failed cell is reported in the results, not raised
        (out / "cells" / cell.name).mkdir(parents=True, exist_ok=True)
        (out / "cells" / cell.name / "error.txt").write_text(traceback.format_exc())
        result = {"row": _failed_row(cell, exc), "evals": [], "train": []}
    row = result["row"]
    say(
        f"cell {position} {cell.name}: {row['status']} in {time.monotonic() - t:.0f} s"
        + (f", val loss {row['final_val_loss']:.3f}" if row["status"] == "ok" else f" ({row['error']})")
    )
    return result


def _failed_row(cell, exc: Exception) -> dict:
    return {
        **cell.columns(),
        "status": "failed",
        "error": f"{type(exc).__name__}: {exc}"[:300],
    }


def outer_sync_rows(scenario: Scenario, work: Path, rows: list[dict] | None = None) -> list[dict]:
    """One outer round per (profile, N, repeat, method), appended to `rows` as each is measured."""
    rows = [] if rows is None else rows
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
