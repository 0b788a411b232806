"""`noloco-node demo`: train D replicas x P stages of a tiny Llama on the embedded corpus."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a tiny model on the embedded corpus and write a summary",
                              description=__doc__)
    add_config_flags(p)
    p.add_argument("--steps", type=int, default=60, help="inner steps (default 60)")
    p.add_argument("--stages", type=int, help="pipeline stages P (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage D (default 2)")
    p.add_argument("--method", choices=["noloco", "diloco", "dp", "none"], help="outer method (default noloco)")
    p.add_argument("--out", default="runs/demo", help="output folder for summary.json (default runs/demo)")
    p.set_defaults(run=run)


def demo_defaults(steps: int) -> dict[str, dict]:
    """Settings that make a CPU demo learn visibly in a minute; a config file or --set wins."""
    return {
        "pipeline": {"batch_size": 8, "microbatch_size": 4},
        "inner": {"lr": 3e-3, "warmup_steps": max(1, steps // 10), "total_steps": max(1, steps)},
        "outer": {"inner_steps_per_outer": 10},
    }


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.replicas < 1:
        raise SystemExit("demo: --steps and --replicas must be >= 1")
    config = resolve_config(args, base=demo_defaults(args.steps),
                            flags={"pipeline": {"num_stages": args.stages}, "outer": {"method": args.method}})
    import torch

    from noloco_node.data.corpus import resolve_corpus
    from noloco_node.data.tokenizer import load_tokenizer
    from noloco_node.pipeline.local import run_local
    from noloco_node.runtime.logging import ProgressLine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    corpus = resolve_corpus(config.data.path, cache_dir=config.data.cache_path, text_field=config.data.text_field)
    tokenizer = load_tokenizer(config.data.tokenizer, corpus, vocab_size=config.data.vocab_size,
                               cache_dir=config.data.cache_path)
    log.info("demo: %s, D=%d replicas x P=%d stages, %d inner steps, corpus %s, vocab %d",
             config.outer.method, args.replicas, config.pipeline.num_stages, args.steps, corpus.name, len(tokenizer))
    progress = ProgressLine()
    summary = run_local(config, num_replicas=args.replicas, steps=args.steps, corpus=corpus, tokenizer=tokenizer,
                        progress=lambda i, n, loss: progress.update(f"step {i}/{n}  loss {loss:.3f}"))
    progress.close()
    summary["config"] = config.to_dict()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"method {summary['method']}: D={summary['replicas']} x P={summary['stages']}, {summary['inner_steps']} inner steps, "
          f"{summary['tokens_per_s']:.0f} tok/s")
    print(f"train loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}; "
          f"validation loss {summary['val_loss_first']:.3f} -> {summary['val_loss_last']:.3f}")
    print(f"outer steps {summary['outer']}, replica spread {summary['replica_spread_last']:.2e}")
    print(f"wrote {out / 'summary.json'}")
    return 0
