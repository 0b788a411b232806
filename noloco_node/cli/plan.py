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
    p.add_argument("--gpu", help=f"device name for its TFLOP/s: {', '.join(_tflops_table())}")
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

    from noloco_node.model.memory import available_bytes

    free = available_bytes(torch.device("cuda" if device_type == "cuda" else "cpu"))
    if free is None:
        raise SystemExit("noloco-node: cannot tell this machine's free memory; pass --memory-gib N")
    return float(free), f"{free / GIB:.1f} GiB free on this machine's {device_type}"


def run(args: argparse.Namespace) -> int:
    from noloco_node.config import ConfigError

    flags = {"model": {"preset": args.preset}}
    cfg = resolve_config(args, flags=flags)
    if not 0 < args.headroom <= 1:
        raise ConfigError("--headroom", f"must be in (0, 1], got {args.headroom}", "use e.g. 0.9")
    from noloco_node.model.build import resolve_llama_config

    llama = resolve_llama_config(cfg.model, vocab_size(cfg))
    device_type = args.device or ("cuda" if args.memory_gib is not None or _has_gpu() else "cpu")
    memory, memory_text = _memory(args, device_type)
    plan = find_plan(cfg, llama, args.headroom * memory, device_type)
    _check_link_flags(args)
    has_link = args.link is not None or args.uplink is not None
    link = _link_prediction(args, cfg, llama, plan) if plan is not None and has_link else None
    report = _report(cfg, llama, plan, device_type, memory, args.headroom, link)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, memory_text)
    return 0 if plan is not None else 1


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _link_prediction(args, cfg, llama, plan) -> dict:
    from noloco_node.config import ConfigError
    from noloco_node.model.costs import DEFAULT_MFU, DEVICE_TFLOPS, Link, pipeline_costs, predict
    from noloco_node.model.memory import workload_for

    tflops = args.device_tflops or DEVICE_TFLOPS.get((args.gpu or "").lower())
    if not tflops:
        raise ConfigError(
            "--device-tflops",
            "the link model needs the device's speed",
            f"pass --device-tflops X or --gpu NAME ({', '.join(DEVICE_TFLOPS)})",
        )
    run_cfg, p, o = plan["config"], plan["config"].pipeline, plan["config"].outer
    common = dict(
        microbatch=p.microbatch_size,
        seq_len=cfg.model.seq_len,
        microbatches_per_batch=p.batch_size // p.microbatch_size,
        max_in_flight=p.max_in_flight,
        checkpointing=p.activation_checkpointing,
        activation_codec=p.activation_codec,
        gradient_codec=getattr(p, "gradient_codec", None),
        outer_payload=workload_for(run_cfg, "cuda").outer_payload,
        inner_steps_per_outer=o.inner_steps_per_outer,
        subspace=cfg.model.residual_subspace,
    )
    mfu = args.mfu or DEFAULT_MFU
    up = args.link if args.link is not None else args.uplink
    link = Link(up, args.rtt, downlink_mbit=args.downlink)
    out = {
        "link_mbit": up,
        "downlink_mbit": args.downlink or up,
        "rtt_ms": args.rtt,
        "device_tflops": tflops,
        "mfu": mfu,
    }
    out["subspace"] = subspace_options(
        llama, plan, common, link, tflops=tflops, mfu=mfu, schedule=plan["settings"].schedule
    )
    out["outer_round"] = outer_round_options(
        llama, plan, common, link, tflops=tflops, mfu=mfu, schedule=plan["settings"].schedule, run_cfg=run_cfg
    )
    for schedule in ("exact", "overlap"):
        for overlap in (False, True):
            costs = pipeline_costs(llama, plan["ranges"], schedule=schedule, outer_overlap=overlap, **common)
            pred = predict(costs, tflops=tflops, mfu=mfu, link=link)
            out[f"{schedule}/{'outer_overlap' if overlap else 'outer_blocking'}"] = {
                "ratio": round(pred.ratio, 4),
                "step_s": pred.step_s,
                "step_unlimited_s": pred.step_unlimited_s,
                "outer_exchange_s": pred.outer_s,
                "round_s": pred.round_s,
                "limited_by": pred.limited_by,
                "compute_s_per_microbatch": list(pred.compute_s),
                "uplink_s_per_microbatch": list(pred.uplink_s),
                "tokens_per_s_per_pipeline": p.batch_size * cfg.model.seq_len * o.inner_steps_per_outer / pred.round_s,
            }
    return out


# The outer exchange as it is configured, and the compressed settings to compare it with
# (codec/names.py; their loss price: docs/experiments/outer_compression).
COMPRESSED_ROUNDS = (("slice:0.03125", "topk:0.02+int4"), ("slice:0.01", "topk:0.02+int2"))


def outer_round_options(llama, plan, common: dict, link, *, tflops: float, mfu: float, schedule: str, run_cfg) -> dict:
    """One outer round's bytes and time per node on this link, for the configured codecs and the
    compressed ones, with the overlapped exchange: whether it hides behind H inner steps."""
    from noloco_node.codec.sizes import bytes_per_element
    from noloco_node.model.costs import pipeline_costs, predict

    o = run_cfg.outer
    configured = tuple(common["outer_payload"])
    rows = []
    for payload in dict.fromkeys([configured, *COMPRESSED_ROUNDS]):
        costs = pipeline_costs(
            llama, plan["ranges"], schedule=schedule, outer_overlap=True, **{**common, "outer_payload": payload}
        )
        pred = predict(costs, tflops=tflops, mfu=mfu, link=link)
        params = max(costs.stage_params)
        compute_s = o.inner_steps_per_outer * pred.step_s
        rows.append(
            {
                "codecs": list(payload),
                "configured": payload == configured,
                "bytes_each_way": params * sum(bytes_per_element(c) for c in payload),
                "fp32_fraction": sum(bytes_per_element(c) for c in payload) / 8,
                "exchange_s": pred.outer_s,
                "h_steps_s": compute_s,
                "hidden": pred.outer_s <= compute_s,
                "ratio": round(pred.ratio, 4),
            }
        )
    return {"inner_steps_per_outer": o.inner_steps_per_outer, "options": rows}


def _check_link_flags(args) -> None:
    from noloco_node.config import ConfigError

    if args.link is not None and args.uplink is not None:
        raise ConfigError(
            "--uplink", "is given with --link", "use --link for a symmetric line, or --uplink and --downlink"
        )
    if args.downlink is not None and args.uplink is None:
        raise ConfigError("--downlink", "is given without --uplink", "add --uplink MBIT (what a node sends through)")
    for flag in ("link", "uplink", "downlink"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag}", f"must be > 0 Mbit/s, got {value}", "give the line's speed in Mbit/s")


def subspace_options(llama, plan, common: dict, link, *, tflops: float, mfu: float, schedule: str) -> dict:
    """Dense and each residual-subspace rank on this link, with the outer exchange overlapped: the
    ratio to the same model unlimited, bytes per forward hop, the frozen table per stage, and the
    time to reach dense bf16's loss relative to dense (tokens needed / tokens per second) where the
    loss price was measured; `recommended` is the rank (0: dense) that gets there soonest."""
    from noloco_node.model.costs import SUBSPACE_PRICE_MIN_HIDDEN, SUBSPACE_TOKEN_PRICE, pipeline_costs, predict

    h = llama.hidden_size
    rows, dense_rate = [], None
    for divisor in (0, 8, 16, 32, 64):
        rank = h // divisor if divisor else 0
        if divisor and rank < 1:
            continue
        costs = pipeline_costs(
            llama, plan["ranges"], schedule=schedule, outer_overlap=True, **{**common, "subspace": rank}
        )
        pred = predict(costs, tflops=tflops, mfu=mfu, link=link)
        rate = 1.0 / pred.round_s  # rounds per second: the same tokens per round for every rank
        dense_rate = dense_rate or rate
        priced = llama.hidden_size >= SUBSPACE_PRICE_MIN_HIDDEN  # `tiny` (hidden 128) paid 1.78x at d/8
        price = 1.0 if not divisor else (SUBSPACE_TOKEN_PRICE.get(divisor) if priced else None)
        rows.append(
            {
                "rank": rank,
                "divisor": divisor,
                "ratio": round(pred.ratio, 4),
                "limited_by": pred.limited_by,
                "tokens_per_s_vs_dense": round(rate / dense_rate, 4),
                "hop_bytes": int(costs.hop_elements * costs.activation_bytes + costs.forward_extra_bytes),
                "frozen_table_bytes": 4 * llama.vocab_size * h + 8 * h * rank if rank else 0,
                "tokens_to_dense_loss": price,
                "time_to_dense_loss_vs_dense": round(price * dense_rate / rate, 4) if price else None,
            }
        )
    timed = [r for r in rows if r["time_to_dense_loss_vs_dense"] is not None]
    best = min(timed, key=lambda r: r["time_to_dense_loss_vs_dense"])["rank"] if len(timed) > 1 else None
    return {"options": rows, "recommended": best}


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
        _print_link(report["link"], report["settings"]["pipeline.schedule"])


def _print_link(link: dict, schedule: str) -> None:
    speeds = (
        f"{link['link_mbit']:g} Mbit/s"
        if link["downlink_mbit"] == link["link_mbit"]
        else f"{link['link_mbit']:g} Mbit/s up, {link['downlink_mbit']:g} Mbit/s down"
    )
    print(f"link {speeds}, RTT {link['rtt_ms']:g} ms, device {link['device_tflops']:g} TFLOP/s x MFU {link['mfu']:g}:")
    for key, p in link.items():
        if not isinstance(p, dict) or key in ("subspace", "outer_round"):
            continue
        mark = "  <- the plan's schedule" if key.startswith(schedule + "/") else ""
        print(
            f"  {key:<24} {p['ratio']:>6.1%} of an unlimited link's tokens/s; step {p['step_s']:.3g} s (unlimited "
            f"{p['step_unlimited_s']:.3g} s), outer exchange {p['outer_exchange_s']:.3g} s; "
            f"{p['tokens_per_s_per_pipeline']:,.0f} tok/s per pipeline; limited by {p['limited_by']}{mark}"
        )
    _print_subspace(link["subspace"])
    _print_outer_round(link["outer_round"])


def _print_outer_round(outer: dict) -> None:
    h = outer["inner_steps_per_outer"]
    print(f"outer round (one node, each way, overlapped with H = {h} inner steps):")
    for r in outer["options"]:
        codecs = " + ".join(r["codecs"]) + ("  <- configured" if r["configured"] else "")
        print(
            f"  {codecs:<40} {r['bytes_each_way'] / 1e6:>9.1f} MB ({r['fp32_fraction']:.2%} of fp32 phi + Delta), "
            f"{r['exchange_s']:.3g} s against {r['h_steps_s']:.3g} s of H steps: "
            f"{'hidden' if r['hidden'] else 'NOT hidden'}; {r['ratio']:.1%} of unlimited"
        )


def _print_subspace(subspace: dict) -> None:
    print("residual subspace (model.residual_subspace; outer exchange overlapped):")
    for r in subspace["options"]:
        name = f"k = d/{r['divisor']} = {r['rank']}" if r["rank"] else "dense"
        when = (
            f"reaches dense bf16's loss in {r['time_to_dense_loss_vs_dense']:.2f}x dense's time "
            f"({r['tokens_to_dense_loss']:.2f}x its tokens)"
            if r["time_to_dense_loss_vs_dense"] is not None
            else "loss price not measured at this rank"
        )
        table = f", frozen table {r['frozen_table_bytes'] / GIB:.2f} GiB per stage" if r["rank"] else ""
        print(
            f"  {name:<16} {r['ratio']:>6.1%} of unlimited, {r['tokens_per_s_vs_dense']:.2f}x dense's tokens/s, "
            f"{r['hop_bytes'] / 1e6:.3g} MB per hop{table}; {when}; limited by {r['limited_by']}"
        )
    best = subspace["recommended"]
    if best is None:
        print("  no rank recommended: no loss price is measured for this model's ranks (measured at hidden >= 1024)")
        return
    print(
        f"  recommended: {'k = ' + str(best) if best else 'dense (no subspace reaches the loss sooner here)'}"
        " (time to dense bf16's loss, from the loss price in docs/research.md: Time to loss)"
    )
