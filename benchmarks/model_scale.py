"""A real model shape on this machine: `model.preset` (default `small`, the paper's 768-hidden,
12-layer Llama) as P=2 stages x 1 replica over gRPC (one torch thread per process), against the
same model trained in one process with the same total threads (two), on the same data.

Prints tokens/s of both and their ratio (after --warmup steps; the one process is timed before and
after the swarm, and the ratio uses their mean, with a warning when they differ by more than 20%),
each stage's peak RSS (VmHWM), the bytes one microbatch's activations take on the wire
(measured: the stage-0 node's payload bytes sent / forwards sent), and the bytes one outer round
sends per stage (computed from the stage's parameter count and outer.codec: with one replica per
stage no round pairs, so none is measured here).

    .venv/bin/python benchmarks/model_scale.py [--preset small] [--steps 3] [--warmup 1] [--seq-len 128]
        [--batch 8] [--micro 2] [--codec bf16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from two_stage_runs import one_process, steadiness, two_stage_swarm

from noloco_node.codec.tensors import encode
from noloco_node.config import load_config
from noloco_node.data.corpus import resolve_corpus
from noloco_node.data.tokenizer import load_tokenizer
from noloco_node.model.build import run_model
from noloco_node.model.memory import stage_params


def overrides(args, cache_dir: str) -> list[str]:
    return [
        f"data.cache_dir={cache_dir}",
        f"model.preset={args.preset}",
        f"model.seq_len={args.seq_len}",
        f"pipeline.batch_size={args.batch}",
        f"pipeline.microbatch_size={args.micro}",
        "pipeline.num_stages=2",
        f"pipeline.activation_codec={args.codec}",
        "inner.lr=1e-4",
        "inner.warmup_steps=1",
        f"inner.total_steps={args.steps + args.warmup}",
        "outer.method=none",
        "timeouts.rpc_s=600",
        "timeouts.microbatch_s=1200",
        "timeouts.receive_s=600",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=["tiny", "small", "medium", "large"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--codec", default="bf16", choices=["none", "bf16", "int8"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = overrides(args, tmp)
        config = load_config(overrides=sets)
        corpus = resolve_corpus(None, cache_dir=config.data.cache_path)
        tokenizer = load_tokenizer(None, corpus, vocab_size=config.data.vocab_size, cache_dir=config.data.cache_path)
        llama, ranges = run_model(config, len(tokenizer))
        params = [stage_params(llama, r, first=s == 0, last=s == 1) for s, r in enumerate(ranges)]
        round_bytes = [len(encode(torch.zeros(n), config.outer.codec)[1]) for n in params]
        print(
            f"model: preset {args.preset} (hidden {llama.hidden_size}, {llama.num_hidden_layers} layers, vocab "
            f"{llama.vocab_size}), stages {[len(r) for r in ranges]} layers, {params} parameters; seq {args.seq_len}, "
            f"batch {args.batch} in microbatches of {args.micro}; activations {args.codec}; {args.steps} timed steps",
            flush=True,
        )
        baseline, rss_one = one_process(config, corpus, tokenizer, args)
        print(f"one process, 2 threads:              {baseline:9.1f} tokens/s, peak RSS {rss_one:.0f} MB", flush=True)
        piped = two_stage_swarm(sets, args, Path(tmp) / "swarm")
        print(
            f"P=2 x 1 over gRPC, 1 thread/process: {piped['tok_s']:9.1f} tokens/s, peak RSS stage 0 "
            f"{piped['peak_rss_mb'][0]:.0f} MB, stage 1 {piped['peak_rss_mb'][1]:.0f} MB"
        )
        again, _ = one_process(config, corpus, tokenizer, args)
        baseline, steady = steadiness(baseline, again)
        print(steady)
        print(f"ratio swarm / one process:           {piped['tok_s'] / baseline:9.3f}")
        print(f"bytes per microbatch hop (measured): {piped['bytes_per_hop']:,.0f}")
        print(
            f"bytes per outer round per stage (computed, outer.codec {config.outer.codec}): "
            f"{', '.join(f'{b:,}' for b in round_bytes)}"
        )
        result = {
            "preset": args.preset,
            "one_process_tok_s": baseline,
            "one_process_tok_s_runs": [baseline * 2 - again, again],
            "swarm_tok_s": piped["tok_s"],
            "ratio": piped["tok_s"] / baseline,
            "peak_rss_mb": {"one_process": rss_one, **{f"stage{k}": v for k, v in piped["peak_rss_mb"].items()}},
            "bytes_per_hop": piped["bytes_per_hop"],
            "outer_round_bytes_computed": round_bytes,
            "params": params,
        }
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
