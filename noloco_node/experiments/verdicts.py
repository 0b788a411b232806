"""The verdicts of an experiment's report: every comparison the grid supports, each with its
uncertainty (aggregate.py's tests), and the cautions that make a comparison less like for like
than it reads (evaluations at different steps, failed seeds, outer rounds that went solo)."""

from __future__ import annotations

import math
import statistics

from noloco_node.config.optimizers import METHOD_DEFAULTS
from noloco_node.experiments.aggregate import paired, paired_verdict, verdict
from noloco_node.experiments.scenario import Scenario

PAPER_PEARSON = (0.91, 0.97)


def _step(group: dict) -> str:
    """A group's final evaluation step; '?' where no seed of it finished."""
    step = group["eval_step"]
    return "?" if math.isnan(step) else str(int(step))


def sync_summary(sync_rows: list[dict]) -> list[dict]:
    """One row per (profile, N): each method's median round time over the repeats, and its bytes."""
    out = []
    for profile in sorted({r["profile"] for r in sync_rows}, key=lambda p: [r["profile"] for r in sync_rows].index(p)):
        for n in sorted({r["n"] for r in sync_rows if r["profile"] == profile}):
            entry = {"profile": profile, "n": n}
            for method in ("noloco", "diloco"):
                runs = [
                    r
                    for r in sync_rows
                    if (r["profile"], r["n"], r["method"]) == (profile, n, method) and not math.isnan(r["median_s"])
                ]
                entry[method] = statistics.median(r["median_s"] for r in runs) if runs else math.nan
                entry[f"{method}_mb"] = statistics.fmean(r["mb_per_node"] for r in runs) if runs else math.nan
                entry[f"{method}_runs"] = len(runs)
            entry["ratio"] = entry["diloco"] / entry["noloco"] if entry["noloco"] > 0 else math.nan
            out.append(entry)
    return out


def verdicts(groups: list[dict], sync_rows: list[dict], scenario: Scenario, cells: list[dict] = ()) -> list[str]:
    """Every comparison the grid supports, each with its uncertainty."""
    by_method: dict[tuple, dict[str, dict]] = {}
    by_variant: dict[tuple, list[dict]] = {}
    for g in groups:
        by_method.setdefault((g["variant"], g["replicas"], g["stages"], g["profile"]), {})[g["method"]] = g
        by_variant.setdefault((g["method"], g["replicas"], g["stages"], g["profile"]), []).append(g)
    equal_time_s = next((g["equal_time_s"] for g in groups), math.nan)
    return [
        *_cautions(groups, cells),
        *_method_verdicts(by_method, equal_time_s),
        *_variant_verdicts(by_variant),
        *_pearson_verdicts(groups, scenario),
        *_sync_verdicts(sync_rows),
    ]


def _cautions(groups: list[dict], cells: list[dict]) -> list[str]:
    """What makes the comparisons below less like for like than they read."""
    out = []
    steps = sorted({int(g["eval_step"]) for g in groups if g["seeds"] and not math.isnan(g["eval_step"])})
    if len(steps) > 1:
        out.append(
            f"Caution: the groups' final evaluations come from different inner steps ({steps}); "
            "the loss comparisons at equal steps are not like for like."
        )
    failed = [g["group"] for g in groups if g["seeds"] < g["cells"]]
    if failed:
        out.append(f"Caution: some seeds failed in {', '.join(failed)}; their groups average fewer seeds.")
    return out + _solo_cautions(cells) + _short_cautions(cells)


def _short_cautions(cells: list[dict]) -> list[str]:
    """A cell where a node ended short of the steps: for DiLoCo and dp it missed the last all-reduce,
    so the replicas did not end on one set of weights and the baseline reads weaker than it is."""
    return [
        f"Caution: {cell['row']['cell']}: node(s) {cell['row']['nodes_short']} (stage, replica: inner steps) "
        f"ended short of its {cell['row']['steps']} inner steps (given fewer microbatches than their peers) and "
        "missed the outer rounds after: that cell's numbers are not the method's at full strength."
        for cell in cells
        if cell["row"]["status"] == "ok" and cell["row"].get("nodes_short")
    ]


def _solo_cautions(cells: list[dict]) -> list[str]:
    """A NoLoCo or DiLoCo cell whose outer rounds mostly found no partner trained as independent
    replicas, whatever its method says: its numbers are not that method's."""
    out = []
    for cell in cells:
        row = cell["row"]
        rounds, solo = row.get("outer_rounds"), row.get("outer_solo")
        if row["status"] != "ok" or row["method"] not in ("noloco", "diloco"):
            continue
        if isinstance(rounds, (int, float)) and isinstance(solo, (int, float)) and rounds > 0 and solo * 2 > rounds:
            out.append(
                f"Caution: {row['cell']}: {int(solo)} of {int(rounds)} outer rounds went solo (no partner within "
                "timeouts.match_s; a loaded machine does this): that cell trained mostly as independent replicas."
            )
    return out


def _method_verdicts(by_method: dict[tuple, dict[str, dict]], equal_time_s: float) -> list[str]:
    """Each pair of methods in the same setting, at the last step and at equal wall time."""
    out = []
    for methods in by_method.values():
        names = [m for m in ("noloco", "diloco", "dp", "none") if m in methods]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ga, gb = methods[a], methods[b]
                out.append(verdict(a, ga["val_loss"], b, gb["val_loss"], f"Validation loss at step {_step(ga)}"))
                out.append(
                    verdict(
                        a,
                        ga["val_loss_equal_time"],
                        b,
                        gb["val_loss_equal_time"],
                        f"Validation loss at equal wall time ({equal_time_s:.0f} s)",
                    )
                )
    return out


def _variant_verdicts(by_variant: dict[tuple, list[dict]]) -> list[str]:
    """Each variant of a method against its first (the baseline), also paired by seed; the spread
    is only compared where replicas drift apart (not under dp)."""
    out = []
    for variants in by_variant.values():
        if len(variants) < 2:
            continue
        base = variants[0]
        for other in variants[1:]:
            a, b = other["group"], base["group"]
            out.append(verdict(a, other["val_loss"], b, base["val_loss"], f"Validation loss at step {_step(base)}"))
            out.append(
                paired_verdict(
                    a,
                    b,
                    paired(other["val_loss_by_seed"], base["val_loss_by_seed"]),
                    f"Validation loss at step {_step(base)}",
                )
            )
            if base["method"] != "dp":
                out.append(verdict(a, other["spread"], b, base["spread"], "Final replica spread"))
                out.append(verdict(a, other["peak_spread"], b, base["peak_spread"], "Peak replica spread"))
    return out


def _pearson_verdicts(groups: list[dict], scenario: Scenario) -> list[str]:
    """Whether each outer-sync group's spread/lr correlation agrees with the paper's range, and
    whether the spread was sampled at one point of the outer round: evaluations every E steps with
    rounds every H sample a sawtooth when E is no multiple of H (a researcher's audit found a D = 2
    run 'agree' through that phase alone)."""
    out = []
    for g in groups:
        p = g["pearson"]
        if g["method"] in ("noloco", "diloco") and p.n:
            lo, hi = PAPER_PEARSON
            inside = p.mean - (2 * p.std if p.n > 1 else 0) <= hi and p.mean + (2 * p.std if p.n > 1 else 0) >= lo
            h = _rounds_every(scenario, g)
            phases = len({step % h for step in range(scenario.eval_every, scenario.steps + 1, scenario.eval_every)})
            out.append(
                f"Pearson(spread, lr) after warm-up, {g['group']}: {p} over {p.n} seed(s); paper {lo}-{hi} -> "
                + (
                    "agrees (the paper's range lies within 2 std)"
                    if inside
                    else "disagrees (outside 2 std of the paper's range)"
                )
                + (
                    f"; but the spread was sampled at {phases} different points of the outer round (eval_every "
                    f"{scenario.eval_every}, H = {h}), so the correlation mixes that phase with the lr: an "
                    "eval_every that is a multiple of H samples one"
                    if phases > 1
                    else ""
                )
                + "."
            )
    return out


def _rounds_every(scenario: Scenario, group: dict) -> int:
    """H of a group's cells: its variant's, else the scenario's overrides', else the method's default."""
    field = "outer.inner_steps_per_outer"
    variant = next((dict(v.overrides) for v in scenario.variants if v.name == group.get("variant")), {})
    value = variant.get(field, scenario.overrides.get(field))
    return int(value) if value is not None else METHOD_DEFAULTS[group["method"]][0]


def _sync_verdicts(sync_rows: list[dict]) -> list[str]:
    """Whether all-reduce's round time over pairwise's grows like log2 N, as the paper argues."""
    out = []
    for row in sync_summary(sync_rows):
        if math.isnan(row["ratio"]):
            continue
        log2n = math.log2(row["n"])
        out.append(
            f"Outer sync {row['profile']}, N={row['n']}: all-reduce / pairwise = {row['ratio']:.2f}x, log2 N = "
            f"{log2n:.2f} -> "
            + ("agrees (within 20% or above)" if row["ratio"] >= 0.8 * log2n else "disagrees")
            + f"; median of {row['noloco_runs']} and {row['diloco_runs']} round(s)."
        )
    return out
