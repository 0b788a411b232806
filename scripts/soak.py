"""Soak: run a local swarm (a bootstrap peer, P stages x D replicas as separate processes on
127.0.0.1) for a fixed time and record, per node and over time, resident memory, open file
descriptors, saved forward inputs and the inner step. Writes soak.csv and prints the first and
last samples per node, then the stage-0 microbatch accounting at the end.

    .venv/bin/python scripts/soak.py --minutes 10 --out runs/soak
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from noloco_node.experiments.launcher import LocalSwarm  # noqa: E402
from noloco_node.runtime.memory import rss_mb  # noqa: E402

TINY = {
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.num_layers": 4,
    "model.num_heads": 4,
    "model.seq_len": 32,
    "data.vocab_size": 512,
    "pipeline.batch_size": 8,
    "pipeline.microbatch_size": 4,
    "inner.lr": 3e-3,
    "inner.warmup_steps": 10,
    "inner.total_steps": 1_000_000,
    "outer.method": "noloco",
    "outer.inner_steps_per_outer": 20,
    "timeouts.match_s": 3.0,
    "timeouts.heartbeat_s": 2.0,
    "timeouts.record_ttl_s": 8.0,
}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"{k}={v}"
        for k, v in {**TINY, "pipeline.num_stages": args.stages, "data.cache_dir": str(out / "cache")}.items()
    ]
    overrides += args.overrides
    rows = []
    with LocalSwarm(out / "swarm", overrides=overrides, threads=1, startup_timeout_s=120) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_node(s, r) for s in range(1, args.stages) for r in range(args.replicas)]
        swarm.wait_ready(servers)
        drivers = [swarm.start_node(0, r, "--steps", "1000000") for r in range(args.replicas)]
        swarm.wait_ready(drivers)
        nodes = servers + drivers
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        while True:
            elapsed = time.monotonic() - start
            for node in nodes:
                if node.proc.poll() is not None:
                    raise SystemExit(
                        f"{node.label} exited with {node.proc.returncode} at {elapsed:.0f} s; see {node.log_file}"
                    )
                info = json.loads(node.ready_file.read_text())
                rows.append(
                    {
                        "t_s": round(elapsed, 1),
                        "node": node.label,
                        "rss_mb": round(rss_mb(node.proc.pid), 1),
                        "open_fds": open_fds(node.proc.pid),
                        "saved_inputs": info.get("saved_inputs"),
                        "in_flight": len(info.get("in_flight", [])),
                        "inner_step": info.get("inner_step"),
                    }
                )
            print(
                f"{elapsed:6.0f} s  "
                + "  ".join(
                    f"{r['node']}: {r['rss_mb']:.0f} MB {r['open_fds']} fds "
                    f"{r['saved_inputs']} saved step {r['inner_step']}"
                    for r in rows[-len(nodes) :]
                ),
                flush=True,
            )
            if time.monotonic() >= deadline:
                break
            time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
        swarm.stop()
        stats = swarm.node_stats()
    with open(out / "soak.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'node':<12} {'t_s':>7} {'rss_mb':>8} {'fds':>5} {'saved':>6} {'step':>7}   (first sample, then last)")
    for label in dict.fromkeys(r["node"] for r in rows):
        mine = [r for r in rows if r["node"] == label]
        for r in (mine[0], mine[-1]):
            print(
                f"{label:<12} {r['t_s']:>7} {r['rss_mb']:>8} {r['open_fds']:>5} {r['saved_inputs']:>6} "
                f"{r['inner_step']:>7}"
            )
    for s in stats.values():
        if "microbatches" in s:
            mb = s["microbatches"]
            print(
                f"stage 0 {s['peer_id'][-6:]}: {s['inner_steps']} steps, microbatches {mb}, "
                f"issued == completed + dropped: {mb['issued'] == mb['completed'] + mb['dropped']}"
            )
        else:
            print(
                f"stage {s['stage']} {s['peer_id'][-6:]}: saved inputs {s['saved_inputs']}, in flight {s['in_flight']}"
            )
    print(f"wrote {out / 'soak.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
