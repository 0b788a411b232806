"""`noloco-node plan` with a link: the run settings this link asks for, all together.

plan_link.py compares each lever alone against the configured run (the compressed outer rounds
with dense hops, the subspace ranks with the configured round), so on a home uplink each looks
small while the other still limits. Here the levers are taken one after another, each kept only
where it pays on this link, in the order their price in loss grows and every one checked with the
ones before it: the outer round's codecs where the configured round does not hide behind H inner
steps, the overlapped exchange, a residual subspace where it reaches dense bf16's loss sooner, int4
hops where the hops still limit. Each candidate is planned again (the memory estimate may ask for
more stages: the outer codecs send two tensors, a subspace adds its frozen tables) and predicted on
the link as the configured run is.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

from noloco_node.cli.plan_link import COMPRESSED_ROUNDS

# What each lever is known to cost in loss, measured (docs/volunteer.md has the tables).
OUTER_PRICE = {
    COMPRESSED_ROUNDS[0]: "loss price not measured (slice:0.0625 + topk:0.02+int2, 3.6% of fp32: +0.163 nats, tiny)",
    COMPRESSED_ROUNDS[1]: "+0.172 nats held-out at tiny over 200 steps, 3 seeds",
}
SUBSPACE_PRICE = "about 1.39x dense bf16's tokens to its loss (hidden 1024, 3 seeds)"
INT4_PRICE = "+0.019 +- 0.015 nats (tiny, 5 seeds: inside the noise)"
OVERLAP_PRICE = "+0.006 +- 0.029 nats (inside the noise)"
OVERLAP_SCHEDULE_PRICE = "+0.069 +- 0.008 nats (tiny, 80 steps, 3 seeds: gradients one step stale)"
WINDOW_LIMIT = "the in-flight window"
SOONER = 0.95  # a subspace is worth its token price when it reaches the loss at least this much sooner
HOPS_LIMIT = ("the link (activations and gradients per microbatch)", "the hops' time in the pipeline's fill and drain")


@dataclass
class Candidate:
    settings: dict[str, object]  # config field ("section.field") -> value
    plan: dict | None
    row: dict | None  # the prediction row the plan's own settings run (plan_link.link_prediction)
    link: dict | None
    hidden_size: int


def together(args: argparse.Namespace, memory_bytes: float, device_type: str) -> dict | None:
    """The settings to add to the run's config for this link (field -> value, with why and each
    one's loss price), its plan's stages and its prediction; None when nothing pays here."""
    base = _evaluate(args, {}, memory_bytes, device_type)
    if base.row is None:
        return None
    current, steps = base, {}
    for _ in range(3):  # a lever can make another pay again: a subspace's faster steps hide less of the round
        changed = False
        for propose in (_outer_codecs, _outer_overlap, _subspace, _int4_hops, _overlap_schedule):
            found = propose(args, current, memory_bytes, device_type)
            if found is not None:
                earlier, (current, why, price) = current.settings, found
                added = {k: v for k, v in current.settings.items() if earlier.get(k) != v}
                before = steps.get(propose.__name__)
                if before is not None:  # the same lever again, further: say both reasons
                    added, why = (
                        {**before["settings"], **added},
                        f"{before['why']}; with the other settings here, {why}",
                    )
                steps[propose.__name__] = {"settings": added, "why": why, "price": price}
                changed = True
        if not changed:
            break
    steps = list(steps.values())
    if not steps:
        return None
    return {
        "settings": current.settings,
        "steps": steps,
        "num_stages": current.plan["num_stages"],
        "ratio": current.row["ratio"],
        "configured_ratio": base.row["ratio"],
        "tokens_per_s_vs_configured": current.row["tokens_per_s_per_pipeline"] / base.row["tokens_per_s_per_pipeline"],
        "subspace_token_price": _token_price(current),
        "limited_by": current.row["limited_by"],
        "tokens_per_s_per_pipeline": current.row["tokens_per_s_per_pipeline"],
    }


def _evaluate(args, settings: dict, memory_bytes: float, device_type: str) -> Candidate:
    from noloco_node.cli.common import resolve_config
    from noloco_node.cli.plan import find_plan, vocab_size
    from noloco_node.cli.plan_link import link_prediction
    from noloco_node.config import ConfigError
    from noloco_node.model.build import resolve_llama_config

    run_args = copy.copy(args)
    run_args.overrides = [*(args.overrides or []), *(f"{k}={_toml(v)}" for k, v in settings.items())]
    try:
        cfg = resolve_config(run_args, flags={"model": {"preset": args.preset}})
    except ConfigError:  # this config refuses the lever (e.g. a subspace with model.init_from): not a candidate
        return Candidate(settings, None, None, None, 0)
    llama = resolve_llama_config(cfg.model, vocab_size(cfg))
    plan = find_plan(cfg, llama, memory_bytes, device_type)
    if plan is None:
        return Candidate(settings, None, None, None, llama.hidden_size)
    link = link_prediction(args, cfg, llama, plan)
    return Candidate(settings, plan, link[f"{plan['settings'].schedule}/{link['outer']}"], link, llama.hidden_size)


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _better(candidate: Candidate, than: Candidate, by: float = 1.0) -> bool:
    """More tokens/s (not a higher ratio: the overlap schedule's unlimited link is faster too)."""
    rate = "tokens_per_s_per_pipeline"
    return candidate.row is not None and candidate.row[rate] > than.row[rate] * by


def _outer_codecs(args, current: Candidate, memory_bytes, device_type):
    """The least compressed round that hides behind H inner steps, where the configured does not
    (NoLoCo's codecs: DiLoCo's all-reduce and dp send what they send)."""
    if current.plan["config"].outer.method != "noloco" or _round_hidden(current):
        return None
    now = (current.settings.get("outer.codec_phi"), current.settings.get("outer.codec_delta"))
    tried = []
    for phi, delta in (
        COMPRESSED_ROUNDS[COMPRESSED_ROUNDS.index(now) + 1 :] if now in COMPRESSED_ROUNDS else COMPRESSED_ROUNDS
    ):
        candidate = _evaluate(
            args, {**current.settings, "outer.codec_phi": phi, "outer.codec_delta": delta}, memory_bytes, device_type
        )
        if candidate.row is not None:
            tried.append(((phi, delta), candidate))
            if _round_hidden(candidate):
                break
    if not tried or not _better(tried[-1][1], current):
        return None
    codecs, chosen = tried[-1]
    row, name = current.row, (" + ".join(now) + "'s" if now in COMPRESSED_ROUNDS else "the configured")
    h = current.plan["config"].outer.inner_steps_per_outer
    hiding_h = math.ceil(row["outer_exchange_s"] / row["step_s"])
    why = (
        f"{name} round ({_seconds(row['outer_exchange_s'])} each way) does not hide behind H inner steps "
        f"({_seconds(h * row['step_s'])}"
        + (
            f"; outer.inner_steps_per_outer = {hiding_h} would, at a loss price not measured)"
            if hiding_h <= 10 * h
            else ")"
        )
    )
    return chosen, why, OUTER_PRICE[codecs]


def _seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 100 else f"{value:.3g} s"


def _round_hidden(candidate: Candidate) -> bool:
    row, h = candidate.row, candidate.plan["config"].outer.inner_steps_per_outer
    return row["outer_exchange_s"] <= h * row["step_s"]


def _outer_overlap(args, current: Candidate, memory_bytes, device_type):
    if current.plan["config"].outer.overlap:
        return None
    candidate = _evaluate(args, {**current.settings, "outer.overlap": True}, memory_bytes, device_type)
    if not _better(candidate, current, 1.02):
        return None
    return candidate, "the exchange runs while the next H inner steps train", OVERLAP_PRICE


def _subspace(args, current: Candidate, memory_bytes, device_type):
    """The rank that reaches dense bf16's loss soonest on this link, if one is sooner than dense:
    its token price x (its round's time / dense's), as plan_link.subspace_options."""
    from noloco_node.model.costs import SUBSPACE_PRICE_MIN_HIDDEN, SUBSPACE_TOKEN_PRICE

    model, width = current.plan["config"].model, current.hidden_size
    if model.residual_subspace or model.init_from or width < SUBSPACE_PRICE_MIN_HIDDEN or _no_hops(current):
        return None
    best, best_time = None, SOONER
    for divisor, price in SUBSPACE_TOKEN_PRICE.items():
        settings = {**current.settings, "model.residual_subspace": width // divisor}
        candidate = _evaluate(args, settings, memory_bytes, device_type)
        if candidate.row is None:
            continue
        time = price * candidate.row["round_s"] / current.row["round_s"]
        if time < best_time:
            best, best_time = candidate, time
    if best is None:
        return None
    return best, f"reaches dense bf16's loss in {best_time:.2f}x dense's time on this link", SUBSPACE_PRICE


def _token_price(candidate: Candidate) -> float | None:
    from noloco_node.model.costs import SUBSPACE_TOKEN_PRICE

    rank = candidate.settings.get("model.residual_subspace")
    return SUBSPACE_TOKEN_PRICE.get(candidate.hidden_size // rank) if rank else None


def _no_hops(candidate: Candidate) -> bool:
    return candidate.plan["num_stages"] == 1


def _int4_hops(args, current: Candidate, memory_bytes, device_type):
    p = current.plan["config"].pipeline
    if (
        _no_hops(current)
        or current.row["limited_by"] not in HOPS_LIMIT
        or (p.activation_codec, p.gradient_codec) == ("int4", "int4")
    ):
        return None
    settings = {**current.settings, "pipeline.activation_codec": "int4", "pipeline.gradient_codec": "int4"}
    candidate = _evaluate(args, settings, memory_bytes, device_type)
    if not _better(candidate, current, 1.05):
        return None
    return candidate, f"the hops limit ({current.row['limited_by']})", INT4_PRICE


def _overlap_schedule(args, current: Candidate, memory_bytes, device_type):
    """Two inner steps' microbatches in flight where one step's do not cover the round trip."""
    if current.plan["config"].pipeline.schedule == "overlap" or not current.row["limited_by"].startswith(WINDOW_LIMIT):
        return None
    candidate = _evaluate(args, {**current.settings, "pipeline.schedule": "overlap"}, memory_bytes, device_type)
    if not _better(candidate, current, 1.05) or candidate.plan["config"].pipeline.schedule != "overlap":
        return None
    return (
        candidate,
        f"one inner step's microbatches do not cover the round trip ({current.row['limited_by']})",
        (OVERLAP_SCHEDULE_PRICE),
    )


def print_together(result: dict | None) -> None:
    if result is None:
        print("together: nothing more pays on this link (each lever above is as configured or would not help)")
        return
    print("together, for this link (the run's settings: whoever starts the run sets them, every node uses the same):")
    for step in result["steps"]:
        fields = ", ".join(f"{k} = {_quoted(v)}" for k, v in step["settings"].items())
        print(f"  {fields}\n      why: {step['why']}; price: {step['price']}")
    print(
        f"  predicted: {result['ratio']:.1%} of an unlimited link's tokens/s (as configured: "
        f"{result['configured_ratio']:.1%}; {_versus_configured(result)}), "
        f"{result['num_stages']} stage{'s' if result['num_stages'] > 1 else ''}, "
        f"{result['tokens_per_s_per_pipeline']:,.0f} tok/s per pipeline; limited by {result['limited_by']}"
    )
    flags = " ".join(f"--set {k}={_toml(v)}" for k, v in result["settings"].items())
    print(f"  as flags (plan again with them for their whole tables): {flags}")


def _versus_configured(result: dict) -> str:
    faster, price = result["tokens_per_s_vs_configured"], result["subspace_token_price"]
    said = f"{faster:.1f}x its tokens/s"
    return said if price is None else f"{said}, {faster / price:.1f}x after the subspace's {price:.2f}x token price"


def _quoted(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, int) else f'"{value}"'
