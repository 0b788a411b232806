"""`noloco-node config show`: print the resolved config (defaults < file < flags) as JSON, with the
model the run will train filled in (a preset's shape, or the model.config's) and its layer split
per stage."""

from __future__ import annotations

import argparse
import json

from noloco_node.cli.common import add_config_flags, resolve_config


def register(subparsers) -> None:
    p = subparsers.add_parser("config", help="show the resolved node config", description=__doc__)
    p.add_argument("action", choices=["show"])
    add_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args)
    print(json.dumps(resolved(config), indent=2))
    return 0


def resolved(config) -> dict:
    """The config as a dict, the model's shape resolved, plus `model_resolved` and `stages`."""
    from noloco_node.cli.plan import model_summary, vocab_size
    from noloco_node.model.build import run_model
    from noloco_node.model.memory import stage_params

    out = config.to_dict()
    llama, ranges = run_model(config, vocab_size(config))
    if not (config.model.config or config.model.init_from):  # shape fields stay unset with a config file
        out["model"].update(
            hidden_size=llama.hidden_size,
            intermediate_size=llama.intermediate_size,
            num_layers=llama.num_hidden_layers,
            num_heads=llama.num_attention_heads,
        )
    last = len(ranges) - 1
    counts = [stage_params(llama, r, first=s == 0, last=s == last) for s, r in enumerate(ranges)]
    out["model_resolved"] = {
        **model_summary(config, llama),
        "parameters": stage_params(llama, range(llama.num_hidden_layers), first=True, last=True),
    }
    out["stages"] = [
        {"stage": s, "layers": [r.start, r.stop - 1], "num_layers": len(r), "parameters": n}
        for s, (r, n) in enumerate(zip(ranges, counts))
    ]
    return out
