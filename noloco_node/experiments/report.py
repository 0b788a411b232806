"""report.md for an experiment folder: the command to reproduce, the machine, the measured links,
the claims the scenario checks, the groups (mean ± std over seeds), verdicts that say whether a
difference stands out of the seed noise, every cell, the outer-sync table and the figures."""

from __future__ import annotations

import math
from pathlib import Path

from noloco_node.experiments.aggregate import Stat
from noloco_node.experiments.scenario import Scenario
from noloco_node.experiments.verdicts import sync_summary, verdicts


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
    stopped: str = "",
) -> None:
    rows = [c["row"] for c in cells]
    lines = _header(scenario, command=command, machine=machine, elapsed_s=elapsed_s, notes=notes)
    if stopped:
        lines[1:1] = ["", f"**Not a whole run**: {stopped}."]
    lines += _links_table(links)
    if groups:
        lines += _groups_table(groups, scenario)
    lines += _verdicts_section(groups, sync_rows, scenario, cells)
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
        "| profile | RTT measured (ms) | RTT profile (ms) | jitter profile (ms, one way) | Mbit/s measured "
        "| Mbit/s profile |",
        "|---|---|---|---|---|---|",
    ]
    for link in links:
        p = link["profile"]
        lines.append(
            f"| {p['name']} | {link['rtt_ms']:.1f} | {2 * p['one_way_ms']:.0f} | ± {p.get('jitter_ms', 0):g} | "
            f"{link['mbit']:.1f} | {p['mbit'] or 'unlimited'} |"
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


def _verdicts_section(groups: list[dict], sync_rows: list[dict], scenario: Scenario, cells: list[dict]) -> list[str]:
    """How a difference is called one, then every verdict."""
    seeds = len(scenario.seeds)
    noise = (
        "With one seed per group there is no error estimate, so no difference is called one."
        if seeds == 1
        else f"With {seeds} seeds per group the error estimate itself is rough."
    )
    lines = [
        "",
        "## Verdicts",
        "",
        "Each difference is given with its standard error over seeds; it is called a difference only when it "
        f"exceeds twice that error. {noise} A seed fixes the initial weights and the data; the outer rounds' "
        "pairings depend on timing, so two runs of one seed differ too (by about the spread between seeds on a "
        "loaded machine).",
        "",
    ]
    return lines + [f"- {v}" for v in verdicts(groups, sync_rows, scenario, cells)]


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
    legend = (
        "Outer rounds, summed over the cell's nodes (rounds = paired + solo + skipped): paired (met a partner: "
        "NoLoCo's exchange, or an all-reduce group of two or more), solo (no partner in time: the node stepped "
        "alone), skipped (dp: a round without an update, taken by all replicas together), partial (all-reduce "
        "rounds that delivered part of the mean only; already counted among the paired or solo), resynced (dp: "
        "of the skipped, rounds that found the replicas apart and averaged them back)."
    )
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
    return lines + ["", legend]


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
