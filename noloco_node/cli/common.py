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


def check_listen(host: str, ports: dict[str, int | None], host_field: str) -> None:
    """Fail fast, naming the flag and the fix, when `host` is not an address of this machine or a
    fixed port is taken: started anyway, the node would only fail later, far from the cause (a TLS
    error and a relay fallback). `ports` maps each port's flag or field to its value (0/None = any)."""
    import errno
    import socket

    from noloco_node.config import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for field_name, port in [(host_field, 0), *ports.items()]:
        if port is None or (port == 0 and field_name != host_field):
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart within TIME_WAIT is fine
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(field_name, f"port {port} on {host} is in use (another noloco-node?)",
                                      "stop what holds it, or pick another port") from None
                raise ConfigError(host_field, f"cannot listen on {host!r}: {exc.strerror or exc}",
                                  "use 0.0.0.0 (every interface) or an address of this machine; behind NAT "
                                  "the address peers dial is network.announce_addr, not the host") from None
