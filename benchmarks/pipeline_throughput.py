"""Training throughput of P=2 stages x 1 replica as two processes over gRPC (one torch thread
each) against the same model trained in one process with the same total threads (two).

Both train the same model on the same data for the same steps; tokens/s is measured over the
steps after a warm-up (the swarm from its stage-0 step timestamps, so start-up is excluded).
Prints both figures and their ratio.

    .venv/bin/python benchmarks/pipeline_throughput.py [--steps 20] [--warmup 3] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from two_stage_runs import one_process, two_stage_swarm

from noloco_node.config import load_config
from noloco_node.data.corpus import resolve_corpus
from noloco_node.data.tokenizer import load_tokenizer


def overrides(args, cache_dir: str) -> list[str]:
    return [f"data.cache_dir={cache_dir}", f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.hidden * 11 // 4}",
            f"model.num_layers={args.layers}", "model.num_heads=4", f"model.seq_len={args.seq_len}",
            f"pipeline.batch_size={args.batch}", f"pipeline.microbatch_size={args.micro}", "pipeline.num_stages=2",
            f"pipeline.activation_codec={args.codec}", "inner.lr=1e-3", "inner.warmup_steps=1",
            f"inner.total_steps={args.steps + args.warmup}", "outer.method=none", "pipeline.max_in_flight=16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--codec", default="bf16", choices=["none", "bf16", "int8"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = overrides(args, tmp)
        config = load_config(overrides=sets)
        corpus = resolve_corpus(None, cache_dir=config.data.cache_path)
        tokenizer = load_tokenizer(None, corpus, vocab_size=config.data.vocab_size, cache_dir=config.data.cache_path)
        print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {len(tokenizer)}, seq {args.seq_len}; "
              f"batch {args.batch} in microbatches of {args.micro}; activations {args.codec}; {args.steps} timed steps")
        baseline, _ = one_process(config, corpus, tokenizer, args)
        print(f"one process, 2 threads:              {baseline:9.0f} tokens/s")
        piped = two_stage_swarm(sets, args, Path(tmp) / "swarm")["tok_s"]
        print(f"P=2 x 1 over gRPC, 1 thread/process: {piped:9.0f} tokens/s")
        print(f"ratio swarm / one process:           {piped / baseline:9.3f}")
        print(json.dumps({"one_process_tok_s": baseline, "swarm_tok_s": piped, "ratio": piped / baseline}))


if __name__ == "__main__":
    main()
