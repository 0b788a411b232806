"""`noloco-node config show`: print the resolved config (defaults < file < flags) as JSON."""

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
    print(json.dumps(config.to_dict(), indent=2))
    return 0
