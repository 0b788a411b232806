"""report.md for an experiment folder: the command to reproduce, the machine, the measured links,
the claims the scenario checks, the groups (mean ± std over seeds), verdicts that say whether a
difference stands out of the seed noise, every cell, the outer-sync table and the figures."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from noloco_node.experiments.aggregate import Stat, paired, paired_verdict, verdict
from noloco_node.experiments.scenario import Scenario

PAPER_PEARSON = (0.91, 0.97)


def _fmt(value, digits: int = 3) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _mb(s: Stat) -> str:
    return "n/a" if s.n == 0 or math.isnan(s.mean) else f"{s.mean / 1e6:.3f}"


def _count(row: dict, key: str) -> str:
    """A counter of a results row; '?' for rows written before the counter existed."""
    value = row.get(key)
    return str(int(value)) if isinstance(value, (int, float)) and not math.isnan(value) else "?"


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


def verdicts(groups: list[dict], sync_rows: list[dict], scenario: Scenario) -> list[str]:
    """Every comparison the grid supports, each with its uncertainty."""
    by_method: dict[tuple, dict[str, dict]] = {}
    by_variant: dict[tuple, list[dict]] = {}
    for g in groups:
        by_method.setdefault((g["variant"], g["replicas"], g["stages"], g["profile"]), {})[g["method"]] = g
        by_variant.setdefault((g["method"], g["replicas"], g["stages"], g["profile"]), []).append(g)
    equal_time_s = next((g["equal_time_s"] for g in groups), math.nan)
    return [
        *_cautions(groups),
        *_method_verdicts(by_method, equal_time_s),
        *_variant_verdicts(by_variant),
        *_pearson_verdicts(groups),
        *_sync_verdicts(sync_rows),
    ]


def _cautions(groups: list[dict]) -> list[str]:
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
    return out


def _method_verdicts(by_method: dict[tuple, dict[str, dict]], equal_time_s: float) -> list[str]:
    """Each pair of methods in the same setting, at the last step and at equal wall time."""
    out = []
    for methods in by_method.values():
        names = [m for m in ("noloco", "diloco", "dp", "none") if m in methods]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ga, gb = methods[a], methods[b]
                out.append(
                    verdict(a, ga["val_loss"], b, gb["val_loss"], f"Validation loss at step {int(ga['eval_step'])}")
                )
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
            out.append(
                verdict(a, other["val_loss"], b, base["val_loss"], f"Validation loss at step {int(base['eval_step'])}")
            )
            out.append(
                paired_verdict(
                    a,
                    b,
                    paired(other["val_loss_by_seed"], base["val_loss_by_seed"]),
                    f"Validation loss at step {int(base['eval_step'])}",
                )
            )
            if base["method"] != "dp":
                out.append(verdict(a, other["spread"], b, base["spread"], "Final replica spread"))
                out.append(verdict(a, other["peak_spread"], b, base["peak_spread"], "Peak replica spread"))
    return out


def _pearson_verdicts(groups: list[dict]) -> list[str]:
    """Whether each outer-sync group's spread/lr correlation agrees with the paper's range."""
    out = []
    for g in groups:
        p = g["pearson"]
        if g["method"] in ("noloco", "diloco") and p.n:
            lo, hi = PAPER_PEARSON
            inside = p.mean - (2 * p.std if p.n > 1 else 0) <= hi and p.mean + (2 * p.std if p.n > 1 else 0) >= lo
            out.append(
                f"Pearson(spread, lr) after warm-up, {g['group']}: {p} over {p.n} seed(s); paper {lo}-{hi} -> "
                + (
                    "agrees (the paper's range lies within 2 std)"
                    if inside
                    else "disagrees (outside 2 std of the paper's range)"
                )
                + "."
            )
    return out


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


def _matrix(groups: list[dict], scenario: Scenario) -> list[str]:
    """When every variant sets the same two fields, a table with one field down and the other across."""
    keys = [tuple(k for k, _ in v.overrides) for v in scenario.variants]
    if not keys or len(set(keys)) != 1 or len(keys[0]) != 2:
        return []
    down, across = keys[0]
    values = {v.name: dict(v.overrides) for v in scenario.variants}
    rows_v = list(dict.fromkeys(values[v.name][down] for v in scenario.variants))
    cols_v = list(dict.fromkeys(values[v.name][across] for v in scenario.variants))
    lines = []
    for method in dict.fromkeys(g["method"] for g in groups):
        cell = {
            (values[g["variant"]][down], values[g["variant"]][across]): g
            for g in groups
            if g["method"] == method and g["variant"] in values
        }
        lines += [
            "",
            f"Validation loss (mean ± std over seeds) / MB one node sends on the pipeline (activations or "
            f"gradients) / bytes one node sends per outer round, {method}:",
            "",
            f"| {down} \\ {across} | " + " | ".join(str(c) for c in cols_v) + " |",
            "|---" * (len(cols_v) + 1) + "|",
        ]
        for r in rows_v:
            cells = []
            for c in cols_v:
                g = cell.get((r, c))
                cells.append(
                    "–"
                    if g is None
                    else f"{g['val_loss']} / {_mb(g['pipeline_bytes_per_node'])} MB / "
                    f"{_fmt(g['outer_bytes_per_round'].mean, 0)} B"
                )
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def write_report(
    out: Path,
    scenario: Scenario,
    cells: list[dict],
    groups: list[dict],
    sync_rows: list[dict],
    links: list[dict],
    *,
    command: str,
    machine: str,
    elapsed_s: float,
    figures: list[str],
    notes: tuple[str, ...] = (),
) -> None:
    rows = [c["row"] for c in cells]
    lines = _header(scenario, command=command, machine=machine, elapsed_s=elapsed_s, notes=notes)
    lines += _links_table(links)
    if groups:
        lines += _groups_table(groups, scenario)
    lines += _verdicts_section(groups, sync_rows, scenario)
    if rows:
        lines += _cells_table(rows)
    lines += _sync_table(sync_rows, scenario)
    lines += _files_section(figures)
    (out / "report.md").write_text("\n".join(lines))


def _header(scenario: Scenario, *, command: str, machine: str, elapsed_s: float, notes: tuple[str, ...]) -> list[str]:
    """The title, the command to reproduce, the machine, the re-runs and the paper's claims."""
    lines = [
        f"# Experiment: {scenario.name}",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Machine: {machine}. Total time {elapsed_s / 60:.1f} min. Every node is a separate process on 127.0.0.1 "
        f"behind a delaying, rate-limiting TCP relay (`noloco_node/netem/relay.py`) that carries its gRPC traffic "
        f"and, for DiLoCo and dp, its hivemind all-reduce traffic; DHT control traffic is not delayed.",
        "",
    ]
    if notes:
        lines += ["## Re-runs", ""] + [f"- {n}" for n in notes] + [""]
    if scenario.paper:
        lines += ["## What the paper claims", ""] + [f"- {c}" for c in scenario.paper] + [""]
    return lines


def _links_table(links: list[dict]) -> list[str]:
    """Each profile's link as measured before the run, next to what the profile asks for."""
    lines = [
        "## Links as measured before the run",
        "",
        "| profile | RTT measured (ms) | RTT profile (ms) | Mbit/s measured | Mbit/s profile |",
        "|---|---|---|---|---|",
    ]
    for link in links:
        p = link["profile"]
        lines.append(
            f"| {p['name']} | {link['rtt_ms']:.1f} | {2 * p['one_way_ms']:.0f} | {link['mbit']:.1f} | "
            f"{p['mbit'] or 'unlimited'} |"
        )
    return lines


def _groups_table(groups: list[dict], scenario: Scenario) -> list[str]:
    """One row per group (mean ± std over seeds), then the variants' matrix where there is one."""
    t = groups[0]["equal_time_s"]
    lines = [
        "",
        "## Groups: mean ± std over seeds",
        "",
        f"Equal wall time = {_fmt(t, 1)} s since training start, the latest time every cell reached "
        "(validation loss interpolated between evaluations). Spread: RMS deviation of the replicas' weights "
        "from their mean; Pearson after warm-up. Outer bytes: what one node sends in one paired NoLoCo round.",
        "",
        "| group | seeds | val loss (step) | val loss at equal time | train wall s | final spread | peak spread "
        "| Pearson(spread, lr) | MB/node | pipeline MB/node | outer B/round | outer lag (steps) | Δ rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        lines.append(
            f"| {g['group']} | {g['seeds']}/{g['cells']} | {g['val_loss']} ({_fmt(g['eval_step'], 0)}) | "
            f"{g['val_loss_equal_time']} | {g['train_wall_s']} | {g['spread']} | {g['peak_spread']} | "
            f"{g['pearson']} | {_mb(g['bytes_per_node'])} | {_mb(g['pipeline_bytes_per_node'])} | "
            f"{_fmt(g['outer_bytes_per_round'].mean, 0)} | {g['outer_lag_steps']} | {g['delta_rel_error']} |"
        )
    return lines + _matrix(groups, scenario)


def _verdicts_section(groups: list[dict], sync_rows: list[dict], scenario: Scenario) -> list[str]:
    """How a difference is called one, then every verdict."""
    seeds = len(scenario.seeds)
    lines = [
        "",
        "## Verdicts",
        "",
        "Each difference is given with its standard error over seeds; it is called a difference only when it "
        f"exceeds twice that error. With {seeds} seed{'s' if seeds > 1 else ''} per group the error estimate "
        "itself is rough.",
        "",
    ]
    return lines + [f"- {v}" for v in verdicts(groups, sync_rows, scenario)]


def _cells_table(rows: list[dict]) -> list[str]:
    """One row per cell: its losses, time, bytes, spread and counters, or why it failed."""
    lines = [
        "",
        "## Cells",
        "",
        "| cell | status | final val loss (at step) | final train loss | train wall s | MB/node | idle | spread "
        "| Pearson | outer paired/solo/partial/skipped/resynced | microbatches issued/completed/dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['cell']} | **failed**: {r.get('error', '')} | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['cell']} | ok | {_fmt(r['final_val_loss'])} ({r.get('final_eval_step', '?')}) | "
            f"{_fmt(r['final_train_loss'])} | {_fmt(r['train_wall_s'], 1)} | {r['bytes_per_node'] / 1e6:.2f} | "
            f"{_fmt(r['idle_fraction'], 2)} | {_fmt(r['final_spread'], 5)} | {_fmt(r['spread_lr_pearson'], 2)} | "
            f"{r['outer_paired']}/{r['outer_solo']}/{r.get('outer_partial', 0)}/"
            f"{_count(r, 'outer_skipped')}/{_count(r, 'outer_resynced')} | "
            f"{r['mb_issued']}/{r['mb_completed']}/{r['mb_dropped']} |"
        )
    return lines


def _sync_table(sync_rows: list[dict], scenario: Scenario) -> list[str]:
    """One outer round's time and bytes against N, NoLoCo next to DiLoCo (nothing without sync rows)."""
    summary = sync_summary(sync_rows)
    if not summary:
        return []
    codec = "fp32" if scenario.outer_sync_codec == "none" else scenario.outer_sync_codec
    lines = [
        "",
        "## Outer sync: one round vs N",
        "",
        f"A stage of {scenario.outer_sync_numel:,} fp32 parameters, every peer its own process behind the relay. "
        f"NoLoCo sends its {codec} snapshot to one random partner; DiLoCo is hivemind's butterfly all-reduce "
        f"in fp32 over all N. Per round: the median of the N peers' times; per row: the median over "
        f"{scenario.outer_sync_repeats} round(s), each with fresh peers.",
        "",
        "| profile | N | NoLoCo s | DiLoCo s | DiLoCo/NoLoCo | log2 N | NoLoCo MB/node | DiLoCo MB/node |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        lines.append(
            f"| {row['profile']} | {row['n']} | {_fmt(row['noloco'])} | {_fmt(row['diloco'])} | "
            f"{_fmt(row['ratio'], 2)} | {math.log2(row['n']):.2f} | {_fmt(row['noloco_mb'], 2)} | "
            f"{_fmt(row['diloco_mb'], 2)} |"
        )
    return lines


def _files_section(figures: list[str]) -> list[str]:
    """The figures, and which files the run's folder holds and which stay out of git."""
    return (
        ["", "## Figures", ""]
        + [f"![{name}]({name})\n" for name in figures]
        + [
            "Files: `scenario.json` (resolved scenario), `link_check.json`, `results.csv` (one row per cell), "
            "`groups.csv` (mean and std per group), `outer_sync.csv`, `curves.json`. Per-node events "
            "(`cells/<cell>/events/*.jsonl`), node logs, stats and theta snapshots (`cells/<cell>/swarm/`, "
            "`cells/<cell>/snapshots/`) stay in the run's folder and are not committed: the command above "
            "regenerates them.",
            "",
        ]
    )
