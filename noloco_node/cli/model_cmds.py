"""`noloco-node export | eval | generate`: the trained model as a Hugging Face model directory,
its held-out loss, and text from it. All offline: nothing is downloaded."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the trained model as a Hugging Face model directory",
        description="Build a standard Hugging Face model directory (config.json, safetensors "
        "weights, tokenizer) from a live swarm (phi of a replica of every stage, "
        "over FetchState) or from node checkpoints of every stage. The run's "
        "config (--config/--set) names the model and tokenizer.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="a live swarm's DHT multiaddrs")
    source.add_argument(
        "--from-checkpoint",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="checkpoint directories (checkpoint.dir of the nodes) that hold every stage between them",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="the model directory to write (new or empty; see --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.add_argument(
        "--average",
        action="store_true",
        help="average every live replica (or every checkpoint) of a stage instead of taking one",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each state download (live export)")
    add_config_flags(p)
    p.set_defaults(run=run_export)

    p = subparsers.add_parser(
        "eval", help="held-out loss and perplexity of a model directory, or of a live swarm, on the run's data"
    )
    p.add_argument("model_dir", type=Path, nargs="?", help="a model directory `export` wrote")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="instead: evaluate the live swarm as the reference does (column d = replica d of every "
        "stage, fixed routing; the ensemble's loss is the columns' mean)",
    )
    p.add_argument("--sequences", type=int, default=32, help="held-out sequences to evaluate (default 32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_config_flags(p)
    p.set_defaults(run=run_eval)

    p = subparsers.add_parser("generate", help="print a continuation of a prompt from a model directory")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_generate)


def _model_dir(path: Path) -> Path:
    from transformers.utils import logging as hf_logging

    from noloco_node.config import ConfigError

    hf_logging.disable_progress_bar()  # a bar per load of a small model: noise before the answer

    if not (path / "config.json").is_file():
        raise ConfigError(
            "MODEL_DIR", f"{path} holds no config.json", "point at a directory `noloco-node export` wrote"
        )
    return path


def run_export(args: argparse.Namespace) -> int:
    from noloco_node.node.export import ExportError, check_out_dir, write_run_model
    from noloco_node.node.export_sources import weights_from_checkpoints
    from noloco_node.node.manifest import load_run_inputs

    config = resolve_config(args, flags={"network": {"initial_peers": args.initial_peers}})
    _, tokenizer, manifest_hash = load_run_inputs(config)
    try:
        check_out_dir(args.out, overwrite=args.overwrite)
        if args.initial_peers:
            import asyncio

            from noloco_node.node.export import fetch_replicas, merge_stages
            from noloco_node.model.build import run_model

            llama, ranges = run_model(config, len(tokenizer))
            found = asyncio.run(
                fetch_replicas(
                    config, manifest_hash, llama, ranges, every_replica=args.average, timeout_s=args.timeout_s
                )
            )
            weights = merge_stages({s: [phi for _, phi, _ in got] for s, got in found.items()}, args.average)
            kind = "phi of " + ", ".join(
                f"stage {s}: {' + '.join(p[-8:] for p, _, _ in got)}" for s, got in sorted(found.items())
            )
        else:
            weights, kind = weights_from_checkpoints(
                list(args.from_checkpoint), config, manifest_hash, average=args.average
            )
        out = write_run_model(config, weights, tokenizer, args.out)
    except ExportError as exc:
        print(f"noloco-node export: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {out} ({sum(t.numel() for t in weights.values()):,} parameters, {kind}"
        f"{', replicas averaged' if args.average else ''})"
    )
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from noloco_node.experiments.evaluate import held_out_windows

    config = resolve_config(args, flags={"network": {"initial_peers": args.initial_peers}})
    if args.initial_peers:
        return _eval_swarm(config, args)
    if args.model_dir is None:
        print("noloco-node eval: give a MODEL_DIR, or --initial-peers MADDR for a live swarm", file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(_model_dir(args.model_dir), local_files_only=True, dtype=torch.float32)
    model.eval()
    inputs, labels, tokenizer = held_out_windows(config, args.sequences)
    if len(tokenizer) > model.config.vocab_size:
        print(
            f"noloco-node eval: the run's tokenizer has {len(tokenizer)} tokens, the model {model.config.vocab_size}; "
            "pass the run's --config",
            file=sys.stderr,
        )
        return 1
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(inputs), 8):
            logits = model(input_ids=inputs[i : i + 8]).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[i : i + 8].reshape(-1), reduction="sum"
            ).item()
            count += labels[i : i + 8].numel()
    loss = total / count
    result = {
        "model_dir": str(args.model_dir),
        "sequences": len(inputs),
        "tokens": count,
        "loss": loss,
        "perplexity": math.exp(loss),
    }
    print(
        json.dumps(result)
        if args.json
        else f"held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f} ({len(inputs)} sequences, {count} tokens)"
    )
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = _model_dir(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    model.eval()
    ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(args.seed)
    sampling = args.temperature > 0
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            do_sample=sampling,
            temperature=args.temperature if sampling else None,
            top_p=None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
    print(args.prompt + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return 0


def _left_out(per_stage: list, width: int) -> str:
    """Which replicas are in no column (a stage with more replicas than the narrowest one has)."""
    extra = {s: len(r) - width for s, r in enumerate(per_stage) if len(r) > width}
    if not extra:
        return ""
    return "; in no column: " + ", ".join(f"{n} replica(s) of stage {s}" for s, n in extra.items())


def _eval_swarm(config, args: argparse.Namespace) -> int:
    import asyncio

    from noloco_node.experiments.evaluate import column_losses, held_out_windows, replica_spread
    from noloco_node.node.export import ExportError, fetch_replicas
    from noloco_node.node.manifest import load_run_inputs
    from noloco_node.model.build import build_run_stage, run_model

    _, _, manifest_hash = load_run_inputs(config)
    inputs, labels, tokenizer = held_out_windows(config, args.sequences)
    llama, ranges = run_model(config, len(tokenizer))
    try:
        found = asyncio.run(fetch_replicas(config, manifest_hash, llama, ranges, every_replica=True, timeout_s=300.0))
    except ExportError as exc:
        print(f"noloco-node eval: {exc}", file=sys.stderr)
        return 1
    per_stage = [sorted(found[s], key=lambda e: e[0]) for s in range(config.pipeline.num_stages)]
    width = min(len(r) for r in per_stage)  # D columns; a stage with more replicas contributes its first D
    columns = [[per_stage[s][d][1] for s in range(len(per_stage))] for d in range(width)]
    stages = [build_run_stage(config, llama, ranges, s).eval() for s in range(len(per_stage))]
    losses = column_losses(stages, columns, inputs, labels)
    loss = sum(losses) / len(losses)
    result = {
        "swarm": list(config.network.initial_peers),
        "columns": width,
        "column_losses": losses,
        "loss": loss,
        "perplexity": math.exp(loss),
        "spread": replica_spread([[phi for _, phi, _ in r] for r in per_stage]),
        "replicas": [[peer for peer, _, _ in r] for r in per_stage],
        "sequences": len(inputs),
    }
    print(
        json.dumps(result)
        if args.json
        else f"swarm held-out loss {loss:.4f} (mean of {width} columns: {', '.join(f'{x:.4f}' for x in losses)}), "
        f"perplexity {math.exp(loss):.2f}, replica spread {result['spread']:.3g} over every stage's replicas"
        + _left_out(per_stage, width)
    )
    return 0
