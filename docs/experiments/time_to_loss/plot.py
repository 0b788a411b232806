"""Held-out loss against tokens and against wall-clock over a 20 and a 1000 Mbit/s link (mean over
seeds; benchmarks/time_to_loss.py's JSON). .venv/bin/python docs/experiments/time_to_loss/plot.py"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def mean_curve(runs):
    steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in runs]))
    by = [{p["step"]: p["held_out"] for p in r["curve"]} for r in runs]
    return steps, [sum(b[s] for b in by) / len(by) for s in steps]


fig, axes = plt.subplots(2, 3, figsize=(16, 9))
for row, name in enumerate(("wide_h200", "tiny_h200")):
    result = json.loads((HERE / f"{name}.json").read_text())
    args, rows = result["args_raw"], result["summary"]["targets"][0]["rows"]
    step_s = {r["config"]: r["links"] for r in rows}
    for cfg in result["configs"]:
        runs = [r for r in result["runs"] if r["config"] == cfg["key"]]
        steps, loss = mean_curve(runs)
        style = "-" if cfg["k"] == 0 else "--"
        tokens = [s * args["batch"] * args["seq_len"] / 1e6 for s in steps]
        axes[row][0].plot(tokens, loss, style, label=cfg["name"])
        for col, mbit in ((1, "20.0"), (2, "1000.0")):
            axes[row][col].plot([s * step_s[cfg["key"]][mbit]["step_s"] for s in steps], loss, style, label=cfg["name"])
    target = sum(result["summary"]["targets"][0]["target"].values()) / 3
    for col, xlabel in enumerate(
        (
            "tokens (M)",
            "seconds at 20 Mbit/s (link model, measured compute)",
            "seconds at 1000 Mbit/s (link model, measured compute)",
        )
    ):
        ax = axes[row][col]
        ax.axhline(target, color="grey", lw=0.8)
        ax.set_ylim(target - 0.3, target + 1.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (mean of 3 seeds)")
        ax.set_title(f"{name}: {result['shape'].split(', heads')[0]}", fontsize=9)
        if col == 1 and row == 0:
            ax.set_xscale("log")
    axes[row][0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "curves.png", dpi=90)
