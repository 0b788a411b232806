"""Put a re-run's cells into an experiment folder: each re-run cell replaces the folder's cell of the
same name (its committed events too), and the CSVs, plots and report are written again from the
merged cells. The links and the outer-sync table stay the folder's own; the report's total time is
the folder's plus the re-run's, and its "Re-runs" section says what was re-run, when and why.

    python -m noloco_node.experiments.merge examples/convergence.toml docs/experiments/convergence \\
        runs/convergence-dp --note "..."
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
from pathlib import Path

from noloco_node.experiments.scenario import Scenario, load_scenario

TEXT_FIELDS = {"cell", "group", "variant", "method", "profile", "status", "error"}


def _typed(key: str, value: str):
    """A CSV field back as the runner wrote it: text, int, or float (empty = NaN)."""
    if key in TEXT_FIELDS:
        return value
    if value == "":
        return math.nan
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return value


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: _typed(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_cells(folder: Path) -> list[dict]:
    """The cells of an experiment folder as the runner holds them: {'row', 'evals', 'train'}."""
    curves = {c["cell"]: c for c in json.loads((folder / "curves.json").read_text())}
    return [
        {
            "row": row,
            "evals": _measured(curves.get(row["cell"], {}).get("evals", [])),
            "train": _measured(curves.get(row["cell"], {}).get("train", [])),
        }
        for row in read_csv(folder / "results.csv")
    ]


def _measured(points: list[dict]) -> list[dict]:
    """A curve's points as the runner held them: null in curves.json (a value not measured) is NaN."""
    return [{k: math.nan if v is None else v for k, v in point.items()} for point in points]


def merge_cells(scenario: Scenario, kept: list[dict], rerun: list[dict]) -> list[dict]:
    """The scenario's cells in grid order, each from the re-run where it has one."""
    by_name = {c["row"]["cell"]: c for c in kept} | {c["row"]["cell"]: c for c in rerun}
    order = [c.name for c in scenario.cells()]
    missing = [name for name in order if name not in by_name]
    if missing:
        raise ValueError(f"no results for {', '.join(missing)} in either folder")
    return [by_name[name] for name in order]


def total_minutes(report: Path) -> float:
    match = re.search(r"Total time ([0-9.]+) min", report.read_text()) if report.exists() else None
    return float(match.group(1)) if match else math.nan


def merge_rerun(scenario: Scenario, folder: Path, rerun: Path, notes: tuple[str, ...]) -> list[dict]:
    """Rewrite `folder` with `rerun`'s cells in place of its own; returns the merged groups."""
    from noloco_node.experiments.outputs import write_outputs

    replaced = read_cells(rerun)
    cells = merge_cells(scenario, read_cells(folder), replaced)
    for cell in replaced:
        name = cell["row"]["cell"]
        shutil.rmtree(folder / "cells" / name, ignore_errors=True)
        (folder / "cells" / name).mkdir(parents=True)
        for part in ("events", "error.txt"):
            source = rerun / "cells" / name / part
            if source.is_dir():
                shutil.copytree(source, folder / "cells" / name / part)
            elif source.exists():
                shutil.copy2(source, folder / "cells" / name / part)
    command = re.search(r"Reproduce: `([^`]*)`", (folder / "report.md").read_text()).group(1)
    minutes = total_minutes(folder / "report.md") + total_minutes(rerun / "report.md")
    return write_outputs(
        folder,
        scenario,
        cells,
        read_csv(folder / "outer_sync.csv"),
        json.loads((folder / "link_check.json").read_text()),
        command=command,
        elapsed_s=60 * minutes,
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", help="the scenario TOML both folders ran")
    parser.add_argument("folder", type=Path, help="the experiment folder to update")
    parser.add_argument("rerun", type=Path, help="the re-run's output folder (noloco-node experiment --out)")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's Re-runs section")
    args = parser.parse_args(argv)
    groups = merge_rerun(load_scenario(args.scenario), args.folder, args.rerun, tuple(args.note))
    for g in groups:
        print(f"{g['group']}: {g['seeds']}/{g['cells']} seeds, val loss {g['val_loss']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
