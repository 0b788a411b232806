"""The experiment's PNG figures (matplotlib, no display needed). Each function takes the reduced
results and writes one file; the report links them."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"noloco": "tab:blue", "diloco": "tab:orange", "dp": "tab:green"}


def _label(row: dict) -> str:
    return f"{row['method']} D{row['replicas']} P{row['stages']} {row['profile']} s{row['seed']}"


def validation_loss(cells: list[dict], path: Path) -> None:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for cell in cells:
        evals = cell["evals"]
        if not evals:
            continue
        color = COLORS.get(cell["row"]["method"])
        by_step.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], marker="o", color=color, label=_label(cell["row"]))
        by_time.plot([e["wall_s"] for e in evals], [e["val_loss"] for e in evals], marker="o", color=color)
    by_step.set(xlabel="inner step", ylabel="validation loss (ensemble mean, nats)", title="validation loss vs inner step")
    by_time.set(xlabel="wall time since training start (s)", title="validation loss vs wall time")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def outer_sync(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["method"], r["profile"]) for r in rows}):
        pts = sorted((r["n"], r["median_s"]) for r in rows if (r["method"], r["profile"]) == key)
        ax.plot([n for n, _ in pts], [s for _, s in pts], marker="o", color=COLORS.get(key[0]), label=f"{key[0]} ({key[1]})",
                linestyle="-" if key[1] == rows[0]["profile"] else "--")
    ax.set(xlabel="replicas N", ylabel="outer sync time, median over peers (s)", title="one outer round vs N", xscale="log")
    ax.set_xticks(sorted({r["n"] for r in rows}), labels=[str(n) for n in sorted({r["n"] for r in rows})])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bars(cells: list[dict], key: str, ylabel: str, title: str, path: Path, scale: float = 1.0) -> None:
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(cells)), 4))
    labels = [_label(c["row"]) for c in cells]
    values = [c["row"][key] * scale if not math.isnan(c["row"][key]) else 0.0 for c in cells]
    ax.bar(range(len(cells)), values, color=[COLORS.get(c["row"]["method"], "gray") for c in cells])
    ax.set_xticks(range(len(cells)), labels=labels, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel=ylabel, title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread_vs_lr(cells: list[dict], path: Path) -> None:
    shown = [c for c in cells if len(c["evals"]) > 1]
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(4.5 * max(1, len(shown)), 3.6), squeeze=False)
    for ax, cell in zip(axes[0], shown):
        evals = [e for e in cell["evals"] if e["step"] > 0]
        ax.plot([e["step"] for e in evals], [e["spread"] for e in evals], marker="o", color=COLORS.get(cell["row"]["method"]))
        ax.set(xlabel="inner step", ylabel="replica weight spread sigma")
        twin = ax.twinx()
        twin.plot([t["step"] for t in cell["train"]], [t["lr"] for t in cell["train"]], color="gray", linestyle="--")
        twin.set_ylabel("inner learning rate (dashed)")
        r = cell["row"]["spread_lr_pearson"]
        ax.set_title(f"{_label(cell['row'])}\nPearson(sigma, lr) = {r:.2f}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
