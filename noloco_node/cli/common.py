"""Flags every command that takes a node config shares."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from noloco_node.config import NodeConfig, load_config


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file (see deploy/node.example.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field, e.g. --set outer.alpha=0.5 (repeatable; wins over --config)")
    parser.add_argument("--swarm-key", metavar="FILE", help="the swarm's shared key file (security.swarm_key_file; "
                        "`noloco-node keygen` makes one); peers without it are refused")


def resolve_config(args: argparse.Namespace, *, base: dict[str, dict[str, Any]] | None = None,
                   flags: dict[str, dict[str, Any]] | None = None) -> NodeConfig:
    """Defaults < command defaults (`base`) < --config < --set < dedicated flags (`flags`)."""
    overrides: dict[str, dict[str, Any]] = {}
    from noloco_node.config import parse_overrides

    for section, content in parse_overrides(args.overrides).items():
        overrides.setdefault(section, {}).update(content)
    if getattr(args, "swarm_key", None):
        overrides.setdefault("security", {})["swarm_key_file"] = args.swarm_key
    for section, content in (flags or {}).items():
        overrides.setdefault(section, {}).update({k: v for k, v in content.items() if v is not None})
    return load_config(args.config, overrides, base=base)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets; call from inside the running event loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
