"""Flags every command that takes a node config shares."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from noloco_node.config import NodeConfig, load_config
from noloco_node.runtime.logging import is_grpc_stream_leak


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file (see deploy/node.example.toml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field, e.g. --set outer.alpha=0.5 (repeatable; wins over --config)",
    )
    parser.add_argument(
        "--swarm-key",
        metavar="FILE",
        help="the swarm's shared key file (security.swarm_key_file; "
        "`noloco-node keygen` makes one); peers without it are refused",
    )


def resolve_config(
    args: argparse.Namespace,
    *,
    base: dict[str, dict[str, Any]] | None = None,
    flags: dict[str, dict[str, Any]] | None = None,
) -> NodeConfig:
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


log = logging.getLogger(__name__)


def require_initial_peers(config: NodeConfig) -> None:
    """Commands that only ask the swarm need a peer of it: from --initial-peers or the config."""
    if not config.network.initial_peers:
        from noloco_node.config import ConfigError

        raise ConfigError(
            "network.initial_peers",
            "no peer of the swarm to ask",
            "pass --initial-peers MADDR (the multiaddr the bootstrap printed) or set network.initial_peers in --config",
        )


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets; call from inside the running event loop. A second
    signal exits at once (a person pressing Ctrl-C again means it). Once stopping, the libp2p
    daemon's connections closing under hivemind's tasks (the signal reached the daemon too: a
    terminal signals the whole process group, systemd the whole cgroup) are expected, not errors."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    first: list[float] = []

    def on_signal(sig: signal.Signals) -> None:
        # A repeat within a second is the same stop delivered twice (`timeout` signals the child and
        # its process group), not a person pressing Ctrl-C again.
        if stop.is_set() and loop.time() - first[0] < 1.0:
            return
        first.append(loop.time())
        if stop.is_set():
            log.warning("second %s: exiting now, without finishing the shutdown", sig.name)
            logging.shutdown()
            os._exit(128 + sig)
        log.info("%s: stopping (again to exit at once)", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if stop.is_set() and isinstance(error, (ConnectionError, asyncio.IncompleteReadError)):
            log.debug("while stopping: %s: %r", context.get("message"), error)
            return
        if is_grpc_stream_leak(context):  # gRPC's, harmless: not an ERROR in a volunteer's log
            log.debug("gRPC left a cut stream's request task: %s", context.get("message"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(on_exception)
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_daemon_closing)
    return stop


def _daemon_closing(record: logging.LogRecord) -> bool:
    """The libp2p daemon's own line when it is signalled with us ('use of closed network connection')."""
    return "use of closed network connection" not in record.getMessage()


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
                    raise ConfigError(
                        field_name,
                        f"port {port} on {host} is in use (another noloco-node?)",
                        "stop what holds it, or pick another port",
                    ) from None
                raise ConfigError(
                    host_field,
                    f"cannot listen on {host!r}: {exc.strerror or exc}",
                    "use 0.0.0.0 (every interface) or an address of this machine; behind NAT "
                    "the address peers dial is network.announce_addr, not the host",
                ) from None
