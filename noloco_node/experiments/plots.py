"""The experiment's PNG figures (matplotlib, no display needed). Each function takes the reduced
results (groups: mean and std over seeds, see aggregate.py) and writes one file; the report
links them. A shaded band is ± one standard deviation over seeds."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"noloco": "tab:blue", "diloco": "tab:orange", "dp": "tab:green", "none": "tab:purple"}


def _color(group: dict, index: int) -> str:
    return COLORS.get(group["method"], "gray") if not group["variant"] else f"C{index % 10}"


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _band(ax, xs, stats, color, label=None, *, floor: float | None = None, **kw) -> None:
    """Mean over seeds, and a band of ± one standard deviation where there are two seeds or more
    (cut at `floor` for a quantity that cannot go below it)."""
    means = [s.mean for s in stats]
    ax.plot(xs, means, marker="o", markersize=3, color=color, label=label, **kw)
    if any(s.n > 1 for s in stats):
        low = [s.mean - s.std for s in stats]
        ax.fill_between(
            xs,
            low if floor is None else [max(floor, v) for v in low],
            [s.mean + s.std for s in stats],
            color=color,
            alpha=0.15,
        )


def _seeds(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def validation_loss(groups: list[dict], cells: list[dict], path: Path) -> None:
    """Left: mean ± std over seeds vs inner step. Right: every seed's curve vs wall time."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for i, g in enumerate(groups):
        if g["curve"]:
            _band(
                by_step,
                list(g["curve"]),
                list(g["curve"].values()),
                _color(g, i),
                label=f"{g['group']} ({_seeds(g['seeds'])})",
            )
        labelled = False
        for c in cells:
            if c["row"].get("group") == g["group"] and c["row"]["status"] == "ok" and c["evals"]:
                by_time.plot(
                    [e["wall_s"] for e in c["evals"]],
                    [e["val_loss"] for e in c["evals"]],
                    color=_color(g, i),
                    alpha=0.7,
                    linewidth=1,
                    label=None if labelled else g["group"],
                )
                labelled = True
    t = groups[0]["equal_time_s"] if groups else math.nan
    if not math.isnan(t):
        by_time.axvline(t, color="gray", linestyle=":", label="equal wall time")
    by_step.set(
        xlabel="inner step",
        ylabel="validation loss, mean over replica columns (nats)",
        title="validation loss vs inner step (band: ± 1 std over seeds)",
    )
    by_time.set(xlabel="wall time since training start (s)", title="validation loss vs wall time (a line per seed)")
    for ax, size in ((by_step, 6), (by_time, 6)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    _save(fig, path)


def spread_vs_lr(groups: list[dict], path: Path) -> None:
    shown = [g for g in groups if len(g["spread_curve"]) > 1 and g["method"] != "dp"]
    cols = min(4, max(1, len(shown)))
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    for i, (ax, g) in enumerate(zip(axes.flat, shown)):
        steps = [k for k in g["spread_curve"] if k > 0]
        _band(ax, steps, [g["spread_curve"][k] for k in steps], _color(g, i), floor=0.0)
        ax.set(xlabel="inner step", ylabel="replica weight spread (band: ± 1 std over seeds)")
        twin = ax.twinx()
        twin.plot(list(g["lr"]), list(g["lr"].values()), color="gray", linestyle="--")
        twin.set_ylabel("inner lr (dashed)")
        ax.set_title(f"{g['group']}\nPearson(spread, lr) = {g['pearson']}", fontsize=8)
    _save(fig, path)


def outer_sync(rows: list[dict], path: Path) -> None:
    """Median round time vs N per method and profile, with log2 N scaled to NoLoCo at N = 2."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    styles = ["-", "--", ":", "-."]
    for row_profile_index, profile in enumerate(profiles):
        pts = [r for r in rows if r["profile"] == profile]
        ns = [r["n"] for r in pts]
        for method in ("noloco", "diloco"):
            if all(math.isnan(r[method]) for r in pts):
                continue  # not measured in this run (or every round failed): no empty legend entry
            ax.plot(
                ns,
                [r[method] for r in pts],
                marker="o",
                color=COLORS[method],
                linestyle=styles[row_profile_index % 4],
                label=f"{method} ({profile})",
            )
        base = next((r["noloco"] for r in pts if r["n"] == 2 and not math.isnan(r["noloco"])), math.nan)
        if not math.isnan(base):
            ax.plot(
                ns,
                [base * math.log2(n) for n in ns],
                color="black",
                alpha=0.4,
                linestyle=styles[row_profile_index % 4],
                label=f"NoLoCo(N=2) x log2 N ({profile})",
            )
    ns = sorted({r["n"] for r in rows})
    ax.set(
        xlabel="replicas N", ylabel="one outer round, median over peers (s)", title="outer sync time vs N", xscale="log"
    )
    ax.set_xticks(ns, labels=[str(n) for n in ns])
    ax.minorticks_off()  # the log axis' minor labels (3 x 10^0 ...) say nothing here
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    _save(fig, path)


def group_bars(groups: list[dict], key: str, ylabel: str, title: str, path: Path, scale: float = 1.0) -> None:
    shown = [g for g in groups if g[key].n]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(shown)), 4))
    ax.bar(
        range(len(shown)),
        [g[key].mean * scale for g in shown],
        yerr=[g[key].std * scale if g[key].n > 1 else 0.0 for g in shown],
        color=[_color(g, i) for i, g in enumerate(shown)],
        capsize=3,
    )
    ax.set_xticks(
        range(len(shown)),
        labels=[f"{g['group']} ({_seeds(g[key].n)})" for g in shown],
        rotation=30,
        ha="right",
        fontsize=7,
    )
    ax.set(ylabel=ylabel)
    ax.set_title(f"{title}\n(mean over seeds, bar: ± 1 std)", fontsize=9)
    _save(fig, path)
