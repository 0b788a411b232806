"""The network side of an outer_peer process (experiments/outer_peer.py): link deadlines under
its command line's policy, the gRPC server behind the admission checks, the dialer's contact
lookup, the stage record it announces in the DHT, and closing it all."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from noloco_node import __version__
from noloco_node.dht.directory import PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.rpc.admission import AdmissionInterceptor
from noloco_node.rpc.guard import GuardLimits, PeerGuard
from noloco_node.rpc.outer_service import OuterClient
from noloco_node.rpc.server import NodeServer
from noloco_node.runtime.link_estimates import DeadlinePolicy, LinkDeadlines, LinkEstimates
from noloco_node.runtime.node_status import Status
from noloco_node.transport.dialer import Contact
from noloco_node.transport.links import Links

RUN, MANIFEST = "outer-test", "m-outer"
log = logging.getLogger("outer_peer")


def link_deadlines(args: argparse.Namespace) -> LinkDeadlines:
    """Deadlines that follow the measured link, under the --assumed-mbit, --stall-s, --deadline-* policy."""
    policy = DeadlinePolicy(
        assumed_bytes_per_s=args.assumed_mbit * 1e6 / 8,
        slack=args.deadline_slack,
        ceiling_s=args.deadline_ceiling_s,
        stall_s=args.stall_s,
    )
    return LinkDeadlines(LinkEstimates(), policy, floor_s=args.match_s)


async def close_all(server: NodeServer, client: OuterClient, links: Links, directory: PeerDirectory) -> None:
    """Stop serving and close the client, links and directory, each given at most 5 s."""
    for step in (server.stop(1.0), client.close(), links.close(), directory.shutdown()):
        try:
            await asyncio.wait_for(step, timeout=5)
        except asyncio.TimeoutError:
            log.warning("shutdown step timed out")


def contact_lookup(directory: PeerDirectory) -> Callable[[str], Awaitable[Contact | None]]:
    """The dialer's lookup: a peer's current record as a transport Contact."""

    async def lookup(peer_id: str):
        r = await directory.record_of(peer_id)
        return None if r is None else Contact(r.peer_id, r.address, r.reach, r.tls_cert, tuple(r.p2p_addrs))

    return lookup


def node_server(args: argparse.Namespace, links: Links) -> NodeServer:
    """The gRPC server on --port, behind the admission checks (a guard generous enough for tests)."""
    guard = PeerGuard(
        GuardLimits(requests_per_s=1000, burst=1000, max_streams=64, ban_after_invalid=5, ban_s=30, ban_max_s=60)
    )
    return NodeServer(
        "127.0.0.1",
        args.port,
        credentials=links.certificate.server_credentials(),
        admission=AdmissionInterceptor(verifier=links.verifier, swarm_key=None, guard=guard, bridged=links.origin),
    )


class Announcer:
    """This peer's stage record in the DHT, announced again at each status change."""

    def __init__(self, directory: PeerDirectory, links: Links, deadlines: LinkDeadlines) -> None:
        self.directory, self.links, self.deadlines = directory, links, deadlines
        self.status = {"status": Status.SERVING, "round": 0, "address": ""}

    async def serve_at(self, address: str) -> None:
        """Announce the address peers dial, serving at round 0."""
        self.status["address"] = address
        await self.set_status(Status.SERVING, 0)

    async def set_status(self, value: str, round_index: int) -> None:
        """sync.ports.SyncParts.set_status: announce `value` at `round_index`."""
        self.status.update(status=value, round=round_index)
        record = StageRecord(
            peer_id=self.directory.peer_id,
            address=self.status["address"],
            stage=0,
            inner_step=0,
            outer_round=round_index,
            status=value,
            tokens_per_s=0.0,
            version=__version__,
            manifest_hash=MANIFEST,
            run_id=RUN,
            updated_at=time.time(),
            tls_cert=self.links.certificate.b64,
            link_mbit_s=round(self.deadlines.estimates.link_mbit_s(), 3),
        )
        await self.directory.announce(record, ttl_s=30)
