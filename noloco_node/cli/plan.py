"""`noloco-node plan`: how many stages a model needs on devices of a given memory, with which
settings, and what each stage needs; with --link, the tokens/s a link leaves of the device's.

    noloco-node plan --preset large --memory-gib 24          # will `large` fit on 24 GB cards, how many of us?
    noloco-node plan --preset medium --memory-gib 80 --link 100 --rtt 30 --gpu h100
    noloco-node plan --preset medium --memory-gib 24 --uplink 20 --downlink 100 --rtt 40 --device-tflops 165

With a link it also says what a residual subspace (model.residual_subspace = hidden / 8 ... / 64:
hops of k values per token, model/subspace.py) would give on it: bytes per hop, the frozen
embedding every stage holds, the tokens/s ratio, and, from the measured loss price (the tokens a
rank needs to reach dense bf16's loss: docs/research.md, Time to loss), the rank that reaches a
given loss soonest over this link, or that dense does.

The memory estimate is model/memory.py's (the one `join` refuses a stage with); the link model is
model/costs.py's. Settings are tried cheapest first for each number of stages: as configured,
then the exact schedule, then activation checkpointing, then a smaller max_in_flight.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from noloco_node.cli.common import add_config_flags, resolve_config

GIB = 1 << 30


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="how many stages a model needs on your devices, and what a link costs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p)
    p.add_argument("--preset", help="model.preset (tiny, small, medium, large); or --set model.* / --config")
    p.add_argument(
        "--memory-gib", type=float, help="memory per device in GiB (default: what this machine's device has free now)"
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help="what computes: cuda (bf16 autocast) or cpu "
        "(fp32); default cuda when --memory-gib is given or a GPU is present",
    )
    p.add_argument(
        "--headroom", type=float, default=0.9, help="share of the memory a stage may use (default 0.9, as join's check)"
    )
    p.add_argument("--link", type=float, metavar="MBIT", help="each node's link bandwidth in Mbit/s (each direction)")
    p.add_argument(
        "--uplink",
        type=float,
        metavar="MBIT",
        help="an asymmetric line: what a node sends through, in Mbit/s (a home uplink); instead of --link",
    )
    p.add_argument(
        "--downlink",
        type=float,
        metavar="MBIT",
        help="with --uplink: what a node receives through (default: the uplink's speed)",
    )
    p.add_argument("--rtt", type=float, default=0.0, metavar="MS", help="round-trip time between nodes in ms")
    p.add_argument(
        "--gpu",
        type=str.lower,
        choices=list(_tflops_table()),
        metavar="NAME",
        help=f"device name for its TFLOP/s: {', '.join(_tflops_table())}",
    )
    p.add_argument("--device-tflops", type=float, help="the device's dense bf16 peak TFLOP/s")
    p.add_argument("--mfu", type=float, help="model FLOPs utilisation while busy (default 0.3)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(run=run)


def _tflops_table() -> dict[str, float]:
    from noloco_node.model.costs import DEVICE_TFLOPS  # pure python: keeps --help instant

    return DEVICE_TFLOPS


@dataclass(frozen=True)
class Settings:
    activation_checkpointing: bool
    schedule: str
    max_in_flight: int


def candidate_settings(pipeline) -> list[Settings]:
    """Cheapest first: as configured, exact, checkpointing, a window of one batch."""
    per_batch = pipeline.batch_size // pipeline.microbatch_size
    out = [
        Settings(pipeline.activation_checkpointing, pipeline.schedule, pipeline.max_in_flight),
        Settings(pipeline.activation_checkpointing, "exact", pipeline.max_in_flight),
        Settings(True, pipeline.schedule, pipeline.max_in_flight),
        Settings(True, "exact", pipeline.max_in_flight),
        Settings(True, "exact", min(pipeline.max_in_flight, per_batch)),
    ]
    return list(dict.fromkeys(out))


def with_settings(cfg, num_stages: int, settings: Settings):
    """`cfg` with `num_stages` and `settings` (layers_per_stage kept only where it matches)."""
    import dataclasses

    p = cfg.pipeline
    pipeline = dataclasses.replace(
        p,
        num_stages=num_stages,
        stage=0,
        layers_per_stage=p.layers_per_stage if len(p.layers_per_stage) == num_stages else (),
        activation_checkpointing=settings.activation_checkpointing,
        schedule=settings.schedule,
        max_in_flight=settings.max_in_flight,
    )
    return dataclasses.replace(cfg, pipeline=pipeline)


def find_plan(cfg, llama, memory_bytes: float, device_type: str, *, max_stages: int | None = None) -> dict | None:
    """The smallest number of stages, with the cheapest settings, whose every stage's estimate fits
    `memory_bytes`; None when even one layer per stage does not."""
    from noloco_node.model.build import stage_ranges
    from noloco_node.model.memory import estimate_for_run

    for num_stages in range(1, (max_stages or llama.num_hidden_layers) + 1):
        for settings in candidate_settings(cfg.pipeline):
            run_cfg = with_settings(cfg, num_stages, settings)
            ranges = stage_ranges(
                llama, num_stages, seq_len=cfg.model.seq_len, layers_per_stage=run_cfg.pipeline.layers_per_stage
            )
            stages = [estimate_for_run(run_cfg, llama, ranges, s, device_type) for s in range(num_stages)]
            if all(m.total <= memory_bytes for m in stages):
                return {
                    "num_stages": num_stages,
                    "settings": settings,
                    "config": run_cfg,
                    "ranges": ranges,
                    "stages": stages,
                }
    return None


def vocab_size(cfg) -> int:
    """The tokenizer's size: data.vocab_size for the trained BPE, else the tokenizer file's."""
    if not cfg.data.tokenizer:
        return cfg.data.vocab_size
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(cfg.data.tokenizer).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception:  # noqa: BLE001 - a hub name or a missing file: the config's own size stands in
        return cfg.data.vocab_size


def _memory(args, device_type: str) -> tuple[float, str]:
    if args.memory_gib is not None:
        return args.memory_gib * GIB, f"{args.memory_gib:g} GiB per device (given)"
    import torch

    if device_type == "cuda" and not torch.cuda.is_available():
        from noloco_node.config import ConfigError

        raise ConfigError(
            "--memory-gib",
            "this machine has no GPU to read the free memory of",
            "pass --memory-gib N, the named card's memory (24 for a 24 GB card)",
        )

    from noloco_node.model.memory import available_bytes

    free = available_bytes(torch.device("cuda" if device_type == "cuda" else "cpu"))
    if free is None:
        raise SystemExit("noloco-node: cannot tell this machine's free memory; pass --memory-gib N")
    return float(free), f"{free / GIB:.1f} GiB free on this machine's {device_type}"


def run(args: argparse.Namespace) -> int:
    from noloco_node.cli.plan_link import check_link_flags, link_prediction
    from noloco_node.config import ConfigError

    flags = {"model": {"preset": args.preset}}
    cfg = resolve_config(args, flags=flags)
    if not 0 < args.headroom <= 1:
        raise ConfigError("--headroom", f"must be in (0, 1], got {args.headroom}", "use e.g. 0.9")
    from noloco_node.model.build import resolve_llama_config

    llama = resolve_llama_config(cfg.model, vocab_size(cfg))
    # --gpu names a card: plan for it, not for this machine's CPU at that card's speed (a newcomer's
    # plan said "device: cpu" beside an H100's TFLOP/s).
    device_type = args.device or ("cuda" if args.memory_gib is not None or args.gpu or _has_gpu() else "cpu")
    memory, memory_text = _memory(args, device_type)
    plan = find_plan(cfg, llama, args.headroom * memory, device_type)
    check_link_flags(args)
    has_link = args.link is not None or args.uplink is not None
    link = link_prediction(args, cfg, llama, plan) if plan is not None and has_link else None
    if link is not None:
        from noloco_node.cli.plan_together import together

        link["together"] = together(args, args.headroom * memory, device_type)
    report = _report(cfg, llama, plan, device_type, memory, args.headroom, link)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, memory_text)
    return 0 if plan is not None else 1


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _report(cfg, llama, plan, device_type: str, memory: float, headroom: float, link: dict | None) -> dict:
    from noloco_node.model.memory import stage_params

    total = stage_params(llama, range(llama.num_hidden_layers), first=True, last=True)
    report = {
        "model": model_summary(cfg, llama),
        "parameters": total,
        "device": device_type,
        "memory_bytes": int(memory),
        "headroom": headroom,
        "fits": plan is not None,
    }
    if plan is None:
        report["problem"] = (
            "even one decoder layer per stage does not fit: use devices with more memory, a "
            "shorter model.seq_len or a smaller pipeline.microbatch_size"
        )
        return report
    s = plan["settings"]
    report.update(
        num_stages=plan["num_stages"],
        settings={
            "pipeline.num_stages": plan["num_stages"],
            "pipeline.activation_checkpointing": s.activation_checkpointing,
            "pipeline.schedule": s.schedule,
            "pipeline.max_in_flight": s.max_in_flight,
        },
        stages=[
            {
                "stage": i,
                "layers": [r.start, r.stop - 1],
                "parameters": m.params,
                "bytes": m.breakdown(),
                "exchange_between_batches": not m.exchange_adds,
            }
            for i, (r, m) in enumerate(zip(plan["ranges"], plan["stages"]))
        ],
    )
    if link is not None:
        report["link"] = link
    return report


def model_summary(cfg, llama) -> dict:
    source = cfg.model.config or cfg.model.init_from
    return {
        "source": f"model.config {source}" if source else f"preset {cfg.model.preset}",
        "hidden_size": llama.hidden_size,
        "intermediate_size": llama.intermediate_size,
        "num_layers": llama.num_hidden_layers,
        "num_heads": llama.num_attention_heads,
        "num_key_value_heads": llama.num_key_value_heads or llama.num_attention_heads,
        "vocab_size": llama.vocab_size,
        "seq_len": cfg.model.seq_len,
        "attn_implementation": cfg.model.attn_implementation,
    }


def _print(report: dict, memory_text: str) -> None:
    m = report["model"]
    print(
        f"model: {m['source']}: hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads, "
        f"intermediate {m['intermediate_size']}, vocab {m['vocab_size']}, seq {m['seq_len']}: "
        f"{report['parameters'] / 1e6:,.1f} M parameters"
    )
    print(f"device: {report['device']}, {memory_text}; a stage may use {report['headroom']:.0%} of it")
    if not report["fits"]:
        print(f"does not fit: {report['problem']}")
        return
    settings = ", ".join(f"{k} = {str(v).lower()}" for k, v in report["settings"].items())
    print(f"fits with {report['num_stages']} stage{'s' if report['num_stages'] > 1 else ''}: {settings}")
    print(
        f"{'stage':>5} {'layers':>8} {'params':>9}  {'state':>7} {'stash':>7} {'activ.':>7} {'saved':>7} "
        f"{'exchange':>9} {'total':>8}   GiB"
    )
    for st in report["stages"]:
        b = st["bytes"]
        state = b["weights"] + b["gradients"] + b["adam"] + b["outer_state"]
        mark = "*" if st["exchange_between_batches"] else " "
        print(
            f"{st['stage']:>5} {st['layers'][0]:>4}-{st['layers'][1]:<3} {st['parameters'] / 1e6:>8.1f}M "
            f"{state / GIB:>7.2f} {b['weight_stash'] / GIB:>7.2f} {(b['activations'] + b['weight_casts']) / GIB:>7.2f} "
            f"{b['saved_inputs'] / GIB:>7.2f} {b['outer_exchange'] / GIB:>8.2f}{mark} {b['total'] / GIB:>8.2f}"
        )
    print(
        "state: weights, gradients, Adam (and phi, m); stash: weight copies (overlap); activ.: kept graphs, bf16 "
        "weight casts and a backward's working set; saved: inputs kept for recompute"
    )
    if any(st["exchange_between_batches"] for st in report["stages"]):
        print("*: a blocking outer exchange runs between batches: the peak is the larger of it and the compute")
    if "link" in report:
        from noloco_node.cli.plan_link import print_link

        from noloco_node.cli.plan_together import print_together

        print_link(report["link"], report["settings"]["pipeline.schedule"])
        print_together(report["link"]["together"])
