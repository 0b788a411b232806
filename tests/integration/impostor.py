"""A hostile peer for tests: joins the DHT under its own key and announces a stage record that
claims ANOTHER node's peer id (its address points elsewhere). Run as a script; it keeps
re-announcing until killed or `--seconds` pass, and writes "ready" to --ready-file first.

    python -m tests.integration.impostor --initial-peers MADDR --victim PEER_ID --run-id R
        --manifest-hash M --stage 1 --num-stages 2 --ready-file FILE
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from noloco_node import __version__
from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.transport.tls import NodeCertificate


async def main(args: argparse.Namespace) -> None:
    directory = await PeerDirectory.start(
        DirectoryIdentity(args.run_id, args.manifest_hash, __version__, args.num_stages),
        initial_peers=[args.initial_peers],
        startup_timeout_s=20,
    )
    certificate = NodeCertificate.generate()
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            record = StageRecord(
                peer_id=args.victim,
                address="127.0.0.1:9",
                stage=args.stage,
                inner_step=0,
                outer_round=0,
                status="serving",
                tokens_per_s=1e9,
                version=__version__,
                manifest_hash=args.manifest_hash,
                run_id=args.run_id,
                updated_at=time.time(),
                tls_cert=certificate.b64,
            )
            stored = await directory.announce(record, ttl_s=5.0)
            if args.ready_file and stored:
                Path(args.ready_file).write_text("ready")
            await asyncio.sleep(1.0)
    finally:
        await directory.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--initial-peers", "--victim", "--run-id", "--manifest-hash", "--ready-file"):
        parser.add_argument(name)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=120.0)
    asyncio.run(main(parser.parse_args()))
