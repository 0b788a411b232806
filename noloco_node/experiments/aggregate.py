"""Across seeds: a scenario's cells grouped by everything but the seed, each number as mean and
standard deviation over the group's seeds, and comparisons between groups that say whether a
difference stands out of the seed-to-seed noise.

A difference of two group means counts as outside the noise when it exceeds twice its standard
error, sqrt(s_a^2 / n_a + s_b^2 / n_b) (about a 95% two-sided bound for a normal difference; with 3
seeds per group the estimate of s is itself rough, which the reports say).

Groups that differ in one option but share their seeds (the same initial weights and data) are
also compared seed by seed: the mean of the per-seed differences against twice its standard error
s_d / sqrt(n). Seed-to-seed noise cancels out of that difference, so it can resolve an option's
price far below the spread between seeds; it says nothing the unpaired test contradicts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "n/a"
        digits = 3 if abs(self.mean) >= 0.1 or self.mean == 0 else 5
        return f"{self.mean:.{digits}f}" + (f" ± {self.std:.{digits}f}" if self.n > 1 else " (1 seed)")


def stat(values) -> Stat:
    kept = [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    if not kept:
        return Stat(math.nan, math.nan, 0)
    # One seed has no spread to estimate: NaN (an empty cell in groups.csv), not a standard deviation of 0.
    return Stat(statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 else math.nan, len(kept))


def loss_at_time(evals: list[dict], t: float) -> float:
    """Validation loss at wall time t, linear between the evaluations around it; NaN past the last."""
    points = sorted((e["wall_s"], e["val_loss"]) for e in evals if not math.isnan(e.get("wall_s", math.nan)))
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1] if points and math.isclose(points[-1][0], t) else math.nan


def group_cells(cells: list[dict]) -> dict[str, list[dict]]:
    """Group name -> its cells that ran to the end, in the order the groups first appear."""
    out: dict[str, list[dict]] = {}
    for cell in cells:
        row = cell["row"]
        out.setdefault(row.get("group", row["cell"]), [])
        if row["status"] == "ok":
            out[row.get("group", row["cell"])].append(cell)
    return out


def equal_time(groups: dict[str, list[dict]]) -> float:
    """The latest wall time every cell of every group reached: where losses compare at equal time."""
    ends = [c["evals"][-1]["wall_s"] for cells in groups.values() for c in cells if c["evals"]]
    return min(ends) if ends else math.nan


def summarize_groups(cells: list[dict]) -> list[dict]:
    groups = group_cells(cells)
    t_equal = equal_time(groups)
    rows = []
    for name, members in groups.items():
        first = members[0]["row"] if members else next(c["row"] for c in cells if c["row"].get("group") == name)
        values = lambda key: [c["row"].get(key, math.nan) for c in members]  # noqa: E731
        curve: dict[int, list[float]] = {}
        spread: dict[int, list[float]] = {}
        for c in members:
            for e in c["evals"]:
                curve.setdefault(e["step"], []).append(e["val_loss"])
                spread.setdefault(e["step"], []).append(e["spread"])
        lr = {t["step"]: t["lr"] for c in members[:1] for t in c["train"]}
        rows.append(
            {
                "group": name,
                "method": first["method"],
                "variant": first.get("variant", ""),
                "replicas": first["replicas"],
                "stages": first["stages"],
                "profile": first["profile"],
                "seeds": len(members),
                "cells": sum(c["row"].get("group", c["row"]["cell"]) == name for c in cells),
                "eval_step": stat(values("final_eval_step")).mean,
                "val_loss": stat(values("final_val_loss")),
                "val_loss_equal_time": stat(loss_at_time(c["evals"], t_equal) for c in members),
                "equal_time_s": t_equal,
                "train_wall_s": stat(values("train_wall_s")),
                "spread": stat(values("final_spread")),
                "peak_spread": stat(max((e["spread"] for e in c["evals"]), default=math.nan) for c in members),
                "pearson": stat(values("spread_lr_pearson")),
                "bytes_per_node": stat(values("bytes_per_node")),
                "pipeline_bytes_per_node": stat(values("pipeline_bytes_per_node")),
                "outer_bytes_per_round": stat(values("outer_bytes_per_round")),
                "outer_lag_steps": stat(values("outer_lag_steps")),
                "val_loss_by_seed": {c["row"]["seed"]: c["row"].get("final_val_loss", math.nan) for c in members},
                "delta_rel_error": stat(values("delta_rel_error")),
                "idle": stat(values("idle_fraction")),
                "curve": {k: stat(v) for k, v in sorted(curve.items())},
                "spread_curve": {k: stat(v) for k, v in sorted(spread.items())},
                "lr": lr,
            }
        )
    return rows


def compare(a: Stat, b: Stat) -> tuple[float, float, bool | None]:
    """(difference a - b, its standard error, whether it is outside the noise; None = cannot tell)."""
    if a.n == 0 or b.n == 0:
        return math.nan, math.nan, None
    diff = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return diff, math.nan, None
    se = math.sqrt(a.std**2 / a.n + b.std**2 / b.n)
    return diff, se, abs(diff) > 2 * se


def verdict(label_a: str, a: Stat, label_b: str, b: Stat, quantity: str) -> str:
    """One sentence: which is lower, by how much, and whether that is inside the noise."""
    diff, se, outside = compare(a, b)
    if math.isnan(diff):
        return f"{quantity}: no data for {label_a if a.n == 0 else label_b}."
    lower = label_a if diff < 0 else label_b
    text = f"{quantity}: {label_a} {a} vs {label_b} {b}; difference {diff:+.4g}"
    if outside is None:
        return text + " (one seed: no noise estimate, so no verdict)."
    if outside:
        return text + f" ± {se:.2g} (SE): {lower} is lower, outside the noise (|diff| > 2 SE)."
    return text + f" ± {se:.2g} (SE): inside the noise (|diff| <= 2 SE), no difference can be claimed."


def paired(a: dict, b: dict) -> Stat:
    """Per-seed differences a - b over the seeds both have (seed -> value maps)."""
    return stat(a[seed] - b[seed] for seed in sorted(set(a) & set(b)))


def paired_verdict(label_a: str, label_b: str, diffs: Stat, quantity: str) -> str:
    """One sentence on a paired difference: its mean, SE, and whether it is outside the noise."""
    if diffs.n < 2:
        return f"{quantity}, seed by seed: {label_a} - {label_b} over {diffs.n} common seed(s): no verdict."
    se = diffs.std / math.sqrt(diffs.n)
    text = (
        f"{quantity}, seed by seed: {label_a} - {label_b} = {diffs.mean:+.4g} ± {se:.2g} (SE over "
        f"{diffs.n} common seeds)"
    )
    if abs(diffs.mean) > 2 * se:
        lower = label_a if diffs.mean < 0 else label_b
        return text + f": {lower} is lower, outside the noise (|diff| > 2 SE)."
    return text + ": inside the noise (|diff| <= 2 SE)."
