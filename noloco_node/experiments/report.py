"""report.md for an experiment folder: the command to reproduce, the machine, the measured links,
the headline tables, the paper's claims checked against these numbers, and the figures."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from noloco_node.experiments.scenario import Scenario


def _fmt(value, digits: int = 3) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _mean(values: list[float]) -> float:
    values = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def claims(rows: list[dict], sync_rows: list[dict]) -> list[str]:
    """The paper's claims, each answered from the measured numbers (agree / disagree / no data)."""
    ok = [r for r in rows if r["status"] == "ok"]
    loss = {m: _mean([r["final_val_loss"] for r in ok if r["method"] == m]) for m in ("noloco", "diloco", "dp")}
    out = []
    eval_steps = sorted({int(r.get("final_eval_step", r["steps"])) for r in ok})
    if len(eval_steps) > 1:  # a cell whose last snapshots were incomplete is compared at an earlier step
        out.append(f"Caution: the cells' final validation losses come from different inner steps ({eval_steps}); "
                   "the loss comparisons below are not like for like.")
    if not math.isnan(loss["noloco"]) and not math.isnan(loss["diloco"]):
        verdict = "agrees" if loss["noloco"] <= loss["diloco"] else "disagrees"
        out.append(f"NoLoCo <= DiLoCo validation loss: NoLoCo {loss['noloco']:.3f} vs DiLoCo {loss['diloco']:.3f} "
                   f"-> {verdict} with the paper.")
    if not math.isnan(loss["dp"]):
        behind = [m for m in ("noloco", "diloco") if not math.isnan(loss[m]) and loss[m] >= loss["dp"]]
        ahead = [m for m in ("noloco", "diloco") if not math.isnan(loss[m]) and loss[m] < loss["dp"]]
        out.append(f"Both behind data-parallel ({loss['dp']:.3f}): behind: {', '.join(behind) or 'none'}; "
                   f"ahead: {', '.join(ahead) or 'none'} -> {'agrees' if not ahead else 'disagrees'}.")
    for profile in sorted({r["profile"] for r in sync_rows}):
        for n in sorted({r["n"] for r in sync_rows if r["profile"] == profile}):
            t = {r["method"]: r["median_s"] for r in sync_rows if r["profile"] == profile and r["n"] == n}
            if "noloco" in t and "diloco" in t and t["noloco"] > 0 and not math.isnan(t["diloco"] + t["noloco"]):
                ratio = t["diloco"] / t["noloco"]
                out.append(f"Outer sync {profile}, N={n}: all-reduce/pairwise = {ratio:.2f}x vs log2(N) = {math.log2(n):.2f} "
                           f"-> {'agrees' if ratio >= 0.8 * math.log2(n) else 'disagrees'} (within 20% or above counts as agreeing).")
    for r in ok:
        if r["method"] == "noloco":
            p = r["spread_lr_pearson"]
            out.append(f"Spread tracks the learning rate ({r['cell']}): Pearson {_fmt(p, 2)} -> "
                       f"{'no data' if math.isnan(p) else 'agrees' if p >= 0.9 else 'disagrees'} (paper: 0.91-0.97).")
    return out


def write_report(out: Path, scenario: Scenario, rows: list[dict], sync_rows: list[dict], links: list[dict], *,
                 command: str, machine: str, elapsed_s: float) -> None:
    lines = [f"# Experiment: {scenario.name}", "",
             f"Reproduce: `{command}`", "",
             f"Machine: {machine}. Total time {elapsed_s / 60:.1f} min. Every node is a separate process on 127.0.0.1 "
             f"behind a delaying, rate-limiting TCP relay (`noloco_node/netem/relay.py`) that carries its gRPC traffic "
             f"and, for DiLoCo and dp, its hivemind all-reduce traffic; DHT control traffic is not delayed.", "",
             "## Links as measured before the run", "",
             "| profile | RTT measured (ms) | RTT profile (ms) | Mbit/s measured | Mbit/s profile |", "|---|---|---|---|---|"]
    for link in links:
        p = link["profile"]
        lines.append(f"| {p['name']} | {link['rtt_ms']:.1f} | {2 * p['one_way_ms']:.0f} | {link['mbit']:.1f} | "
                     f"{p['mbit'] or 'unlimited'} |")
    lines += ["", "## Cells", "",
              "| cell | status | final val loss (at step) | final train loss | train wall s | MB/node | idle | spread | Pearson(spread, lr) "
              "| outer paired/solo/partial | microbatches issued/completed/dropped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['cell']} | **failed**: {r.get('error', '')} | | | | | | | | | |")
            continue
        lines.append(f"| {r['cell']} | ok | {_fmt(r['final_val_loss'])} ({r.get('final_eval_step', '?')}) | "
                     f"{_fmt(r['final_train_loss'])} | "
                     f"{_fmt(r['train_wall_s'], 1)} | {r['bytes_per_node'] / 1e6:.2f} | {_fmt(r['idle_fraction'], 2)} | "
                     f"{_fmt(r['final_spread'], 5)} | {_fmt(r['spread_lr_pearson'], 2)} | {r['outer_paired']}/{r['outer_solo']}/{r.get('outer_partial', 0)} | "
                     f"{r['mb_issued']}/{r['mb_completed']}/{r['mb_dropped']} |")
    lines += ["", "## Outer sync: one round vs N", "",
              f"Stage of {scenario.outer_sync_numel:,} fp32 parameters; NoLoCo sends bf16 to one partner, DiLoCo is "
              "hivemind's butterfly all-reduce in fp32. Median and max over the N peers' round times.", "",
              "| profile | N | NoLoCo median s | DiLoCo median s | DiLoCo/NoLoCo | log2 N | NoLoCo MB/node | DiLoCo MB/node |",
              "|---|---|---|---|---|---|---|---|"]
    for profile in sorted({r["profile"] for r in sync_rows}):
        for n in sorted({r["n"] for r in sync_rows if r["profile"] == profile}):
            by = {r["method"]: r for r in sync_rows if r["profile"] == profile and r["n"] == n}
            nl, dl = by.get("noloco", {}), by.get("diloco", {})
            ratio = dl.get("median_s", math.nan) / nl["median_s"] if nl.get("median_s") else math.nan
            lines.append(f"| {profile} | {n} | {_fmt(nl.get('median_s', math.nan))} | {_fmt(dl.get('median_s', math.nan))} | "
                         f"{_fmt(ratio, 2)} | {math.log2(n):.2f} | {_fmt(nl.get('mb_per_node', math.nan), 2)} | "
                         f"{_fmt(dl.get('mb_per_node', math.nan), 2)} |")
    lines += ["", "## The paper's claims against these numbers", ""] + [f"- {c}" for c in claims(rows, sync_rows)]
    lines += ["", "## Figures", "",
              "![validation loss](validation_loss.png)", "", "![outer sync vs N](outer_sync_vs_n.png)", "",
              "![bytes per node](bytes_per_node.png)", "", "![spread vs lr](spread_vs_lr.png)", "", "![idle time](idle_time.png)", "",
              "Files: `scenario.json` (resolved scenario), `link_check.json`, `results.csv` (one row per cell), "
              "`outer_sync.csv`, `curves.json`, `cells/<cell>/events/*.jsonl` (per-node events); node logs, stats and theta "
              "snapshots are under `cells/<cell>/swarm/` and `cells/<cell>/snapshots/` (not committed for the example).", ""]
    (out / "report.md").write_text("\n".join(lines))
