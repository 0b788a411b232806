"""One outer round of NoLoCo (pairwise exchange) vs DiLoCo (hivemind all-reduce) for N replicas of
one stage, each a separate process on 127.0.0.1 (noloco_node/experiments/outer_peer.py).

For each N and method, all N peers start the round together (a go-file); printed per method are
the median and max wall time of the round over the nodes and the mean payload bytes sent per node,
then the DiLoCo/NoLoCo ratios. NoLoCo bytes are counted on the wire (payload); DiLoCo bytes are
hivemind's butterfly all-reduce payload by its size formula, 2 (N-1)/N x tensor bytes, because
hivemind does not count them. The two methods also differ in wire format: NoLoCo sends --codec
(bf16 by default), hivemind's averager sends fp32.

    .venv/bin/python benchmarks/outer_sync.py [--sizes 2 4 8] [--numel 1000000] [--codec bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from noloco_node.experiments.outer_rounds import run_round
from noloco_node.experiments.process_group import raise_on_signals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--numel", type=int, default=1_000_000, help="parameters in the stage (default 1M)")
    parser.add_argument("--codec", default="bf16", choices=["none", "bf16", "int8"])
    parser.add_argument("--match-s", type=float, default=10.0)
    parser.add_argument("--matchmaking-s", type=float, default=1.0, help="hivemind's minimum matchmaking time")
    args = parser.parse_args()
    print(
        f"stage of {args.numel:,} parameters; NoLoCo codec {args.codec}; DiLoCo fp32, matchmaking >= "
        f"{args.matchmaking_s} s; "
        f"{os.cpu_count()} cores shared by all peers"
    )
    print(f"{'N':>3} {'method':<7} {'median s':>9} {'max s':>7} {'MB/node':>8} {'outcomes':<24}")
    rows = []
    # SIGTERM too unwinds through run_round's `finally`, which ends the round's peers.
    with raise_on_signals(), tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            results = {}
            for method in ("noloco", "diloco"):
                out = run_round(
                    method,
                    n,
                    Path(tmp) / f"{method}-{n}",
                    numel=args.numel,
                    codec=args.codec,
                    match_s=args.match_s,
                    matchmaking_s=args.matchmaking_s,
                )
                seconds = [r["history"][0]["seconds"] for r in out]
                mb = statistics.mean(r["bytes_sent"] for r in out) / 1e6
                outcomes = {o: sum(r["outcome"] == o for r in out) for o in ("paired", "solo")}
                results[method] = (statistics.median(seconds), max(seconds), mb)
                print(
                    f"{n:>3} {method:<7} {statistics.median(seconds):>9.3f} {max(seconds):>7.3f} {mb:>8.2f} "
                    f"{str(outcomes):<24}"
                )
            ratio_t = results["diloco"][0] / results["noloco"][0]
            ratio_b = results["diloco"][2] / results["noloco"][2] if results["noloco"][2] else float("nan")
            print(f"{n:>3} ratio diloco/noloco: time {ratio_t:.2f}x, bytes {ratio_b:.2f}x")
            rows.append(
                {
                    "n": n,
                    "noloco": results["noloco"],
                    "diloco": results["diloco"],
                    "time_ratio": ratio_t,
                    "bytes_ratio": ratio_b,
                }
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
