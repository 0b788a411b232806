"""`noloco-node health`: ask a node's standard gRPC health service (grpc.health.v1, open to
anyone, TLS) whether it is serving; exit 0 if so, 1 if not. For container and service
healthchecks on the node's own machine: the node's self-signed certificate is taken from the
address itself, which is only safe where the path to it is (127.0.0.1)."""

from __future__ import annotations

import argparse
import asyncio
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "health", help="check that a node on this machine is serving (for healthchecks)", description=__doc__
    )
    p.add_argument(
        "--address",
        default="127.0.0.1:31337",
        metavar="HOST:PORT",
        help="the node's gRPC address (network.port; default 127.0.0.1:31337)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import ssl

    from noloco_node.rpc.diagnostics import health_check

    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        print(f"noloco-node health: --address {args.address!r} is not HOST:PORT", file=sys.stderr)
        return 2
    try:
        cert_pem = ssl.get_server_certificate((host, int(port)), timeout=args.timeout).encode()
    except OSError as exc:
        print(f"not serving: nothing answers TLS at {args.address} ({exc.strerror or exc})", file=sys.stderr)
        return 1
    serving, detail, rtt = asyncio.run(health_check(args.address, args.timeout, cert_pem))
    if not serving:
        print(f"not serving: {detail}", file=sys.stderr)
        return 1
    print(f"serving ({rtt * 1e3:.0f} ms)")
    return 0
