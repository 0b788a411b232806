"""State transfer for a joining replica: export a donor's slow weights, outer momentum, Adam
moments and counters as named tensors, and import them on the joiner (which then sets theta = phi).
Runs on the compute thread on both sides, so the exported state is consistent. What travels
exactly and what compactly, and in which order: codec/state_layout.py; fetching from several
donors: sync/state_fetch.py."""

from __future__ import annotations

import json

import torch
from torch import Tensor

from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.state import OuterState


def export_state(outer: OuterState, inner: InnerOptimizer, *, inner_step: int) -> tuple[dict[str, Tensor], dict]:
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in outer.state_dict().items()}
    moments, adam_steps = inner.export_moments({id(p): n for n, p in outer.params.items()})
    tensors.update({k: v.to("cpu") for k, v in moments.items()})
    counters = {"inner_step": inner_step, "outer_round": outer.round, "adam_steps": adam_steps}
    return tensors, counters


def expected_tensors(outer: OuterState) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every name a donor may send, with the shape and dtype this joiner accepts for it."""
    out = {}
    for name, param in outer.params.items():
        master = outer.phi[name].dtype
        out[f"phi/{name}"] = (tuple(param.shape), master)
        out[f"momentum/{name}"] = (tuple(param.shape), master)
        out[f"adam_exp_avg/{name}"] = (tuple(param.shape), param.dtype)
        out[f"adam_exp_avg_sq/{name}"] = (tuple(param.shape), param.dtype)
    return out


def import_state(outer: OuterState, inner: InnerOptimizer, tensors: dict[str, Tensor], counters: dict) -> int:
    """Load a donor's state: phi and m (theta <- phi), Adam moments and step counters. Returns
    the donor's inner step, which becomes ours."""
    outer.load_state_dict(tensors, round_index=int(counters["outer_round"]))
    inner.import_moments(outer.params.items(), tensors, counters.get("adam_steps", {}))
    inner.step_count = int(counters["inner_step"])
    return inner.step_count


def apply_top_up(outer: OuterState, inner: InnerOptimizer, differences: dict[str, Tensor], counters: dict) -> int:
    """Add a top-up's phi/<p> differences to phi (theta <- phi: nothing was trained since the copy)
    and take its counters (sync/top_up.py). Returns the new inner step."""
    with torch.no_grad():
        for name, difference in differences.items():
            parameter = name.partition("/")[2]
            phi = outer.phi[parameter]
            phi += difference.to(phi.device, phi.dtype)
            outer.params[parameter].data.copy_(phi)
    outer.round = int(counters["outer_round"])
    inner.step_count = int(counters["inner_step"])
    return inner.step_count


def counters_json(counters: dict) -> str:
    return json.dumps(counters, sort_keys=True)
