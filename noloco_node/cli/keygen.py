"""`noloco-node keygen`: write a new random swarm key (hex) for `--swarm-key` / security.swarm_key_file.
Give the same file to every peer of the swarm, bootstrap peers included; keep it secret."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("keygen", help="create a swarm key file", description=__doc__)
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the key (refuses to overwrite)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from noloco_node.rpc.admission import generate_key

    path = Path(args.out)
    if path.exists():
        raise SystemExit(f"keygen: {path} exists; a new key would lock its peers out. Remove it first if you mean to.")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_key() + "\n")
    print(f"wrote a swarm key to {path}; start every peer with --swarm-key {path}")
    return 0
