"""The figures of one benchmarks/gpu_call.sh run, from the JSON it left in a folder: each run's
tokens/s as the median over the repeats (and their range), its ratio to the plain loop of the same
repeat (the figure: a repeat's runs share the device and the minute), MFU and each stage's busy-time
MFU; the compiled run beside it; the overlap schedule's held-out loss against exact; the profile
with each result waited for on the compute thread beside the profile as the stage runs now.

    python benchmarks/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RUNS = (
    ("hf", "plain HF loop"),
    ("in_process_exact", "in-process P=2 exact"),
    ("in_process_exact_waiting", "  the same, results waited"),
    ("in_process_overlap", "in-process P=2 overlap"),
    ("processes", "processes P=2 over gRPC"),
)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def summarize(results: list[dict], title: str) -> list[str]:
    lines = [f"{title}: {len(results)} repeat(s) on {results[0].get('device', '?')}"]
    lines.append(f"  {'run':26s} {'tok/s':>9s}  {'x plain loop':22s} {'MFU':22s} busy-time MFU per stage")
    for key, label in RUNS:
        rows = [r for r in results if isinstance(r.get(key), dict) and "tok_s" in r[key]]
        if not rows:
            continue
        tok = [r[key]["tok_s"] for r in rows]
        ratio = [r[key]["tok_s"] / r["hf"]["tok_s"] for r in rows if r.get("hf", {}).get("tok_s")]
        mfu = [r[key]["tok_s"] * r["flops_per_token"] / r["peak_flops"] for r in rows if "flops_per_token" in r]
        stages = {}
        for r in rows:
            for s in r[key].get("stages", []):
                stages.setdefault(s["stage"], []).append(s["busy_mfu"])
        busy = "  ".join(f"stage {k}: {_spread(v)}" for k, v in sorted(stages.items()))
        lines.append(f"  {label:26s} {statistics.median(tok):9.0f}  {_spread(ratio):22s} {_spread(mfu):22s} {busy}")
    refused = {k for r in results for k, v in r.items() if isinstance(v, dict) and "refused" in v}
    lines += [f"  {k}: refused by the memory check" for k in sorted(refused)]
    return lines


def price(rows: list[dict]) -> list[str]:
    lines = ["overlap's price (held-out loss, same seed and steps):"]
    by_seed: dict[int, dict[str, float]] = {}
    for row in rows:
        by_seed.setdefault(row["seed"], {})[row["schedule"]] = row["held_out_loss"]
    for seed, losses in sorted(by_seed.items()):
        gap = losses.get("overlap", float("nan")) - losses.get("exact", float("nan"))
        lines.append(
            f"  seed {seed}: exact {losses.get('exact', float('nan')):.4f}  overlap "
            f"{losses.get('overlap', float('nan')):.4f}  overlap - exact {gap:+.4f}"
        )
    return lines


def main(folder: Path) -> int:
    def load(pattern: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]

    lines: list[str] = []
    for pattern, title in (
        ("stage_eager_*.json", "eager"),
        ("stage_compiled*.json", "decoder layers compiled"),
        ("stage_int8*.json", "int8 hops (encoded on the GPU)"),
        ("stage_subspace*.json", "residual subspace (node runs; the plain loop is dense)"),
    ):
        results = [r for r in load(pattern) if "hf" in r]
        lines += summarize(results, title) if results else [f"{title}: no result"]
    priced = [row for r in load("price*.json") for row in r.get("price_of_overlap", [])]
    lines += price(priced) if priced else ["overlap's price: no result"]
    for shared in load("gpu_shared*.json"):
        alone, pair = shared["alone"]["tok_s"], [r["tok_s"] for r in shared["together"]]
        lines.append(
            f"two processes on the one GPU, half the layers each: alone {alone:.0f} tok/s, together "
            f"{sum(pair):.0f} ({sum(pair) / alone:.3f} of alone: the ceiling of processes P=2 on one GPU)"
        )
    for hops in load("hop_host*.json"):
        lines.append(f"a hop's copy to the device ({hops['preset']}, ms, collect + decode + copy):")
        for codec, phases in hops["codecs"].items():
            kinds = {k: phases.get(f"to device, {k}") for k in ("pageable", "pinned")}
            if None in kinds.values():
                lines.append(f"  {codec}: not measured (no GPU)")
                continue
            pageable, pinned = kinds["pageable"], kinds["pinned"]
            lines.append(
                f"  {codec}: pageable {pageable * 1e3:.2f}  pinned {pinned * 1e3:.2f}  ({pinned / pageable:.2f}x)"
            )
    for step in load("inner_step*.json"):
        lines.append(f"an inner step ({step['device']}, {step['tensors']} tensors), ms and x a bare Adam step:")
        for way in ("adam", "inner", "previous"):
            counts = ", ".join(f"{k} {v}" for k, v in step[way].items() if k not in ("ms", "x_adam"))
            lines.append(f"  {way:9s} {step[way]['ms']:.2f} ms  {step[way]['x_adam']:.2f}x  ({counts})")
    profiles = {"waiting": load("profile_waiting*.json"), "now": load("profile.json")}
    if any(profiles.values()):
        lines += profile_rows({k: v[0] for k, v in profiles.items() if v})
    print("\n".join(lines))
    return 0


def profile_rows(profiles: dict[str, dict]) -> list[str]:
    """gpu_profile.py's figures side by side: each result waited for on the compute thread, and as
    the stage runs now (pipeline.overlap_result_copies)."""
    lines = ["profile (in-process P=2 exact): results waited for on the compute thread | as it runs now"]

    def row(label: str, value) -> None:
        lines.append(f"  {label:38s} " + " | ".join(value(p) for p in profiles.values()))

    row("run", lambda p: p.get("args", {}).get("label", "?"))
    row("tokens/s (MFU), unprofiled", lambda p: f"{p['tok_s']:.0f} ({p['mfu']:.3f})")
    row("wall of the profiled steps, ms", lambda p: f"{p['wall_ms']:.0f}")
    row("GPU busy, ms (of the wall)", lambda p: f"{p['gpu']['busy_ms']:.0f} ({p['gpu']['busy_fraction']:.2f})")
    row("gaps over 0.1 ms: count, ms", lambda p: f"{p['gpu']['gaps_over_0.1ms']}, {p['gpu']['gap_ms_over_0.1ms']:.0f}")
    for stage in sorted({s for p in profiles.values() for s in p.get("stages", {}) if s[1:].isdigit()}):
        row(
            f"{stage}: host syncs (ms blocked), kernel ms",
            lambda p, s=stage: (
                f"{sum(p['stages'][s]['syncs'].values())} ({p['stages'][s]['sync_ms']:.0f}), "
                f"{p['stages'][s]['kernel_ms']:.0f}"
                if s in p.get("stages", {})
                else "-"
            ),
        )
    return lines


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
