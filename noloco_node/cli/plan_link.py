"""`noloco-node plan --link/--uplink`: what a link leaves of a device's tokens/s for a plan that
fits (model/costs.py's link model), per schedule and outer exchange, with the residual-subspace
ranks and the compressed outer rounds to compare; and how the command prints it. Split from
plan.py, which finds the plan and imports this module only when a link is given.
"""

from __future__ import annotations

import argparse

from noloco_node.cli.plan import GIB


def link_prediction(args: argparse.Namespace, cfg, llama, plan: dict) -> dict:
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
        # The outer exchange as the run is configured (outer.overlap): with the plan's pipeline
        # schedule, it names the one row of the four that the plan's settings run.
        "outer": "outer_overlap" if run_cfg.outer.overlap else "outer_blocking",
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


def check_link_flags(args: argparse.Namespace) -> None:
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


def print_link(link: dict, schedule: str) -> None:
    speeds = (
        f"{link['link_mbit']:g} Mbit/s"
        if link["downlink_mbit"] == link["link_mbit"]
        else f"{link['link_mbit']:g} Mbit/s up, {link['downlink_mbit']:g} Mbit/s down"
    )
    print(f"link {speeds}, RTT {link['rtt_ms']:g} ms, device {link['device_tflops']:g} TFLOP/s x MFU {link['mfu']:g}:")
    for key, p in link.items():
        if not isinstance(p, dict) or key in ("subspace", "outer_round", "together"):
            continue
        mark = "  <- the plan's settings" if key == f"{schedule}/{link['outer']}" else ""
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
