"""Two steps of joining a running swarm, before a node announces itself: ask live peers whether
our announced address reaches us, and copy a live replica's training state."""

from __future__ import annotations

import logging
import random

from noloco_node.dht.directory import PeerDirectory
from noloco_node.errors import NodeError, UnreachableAddress
from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.state import OuterState
from noloco_node.rpc.outer_service import OuterClient
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.transfer import expected_tensors, import_state

log = logging.getLogger(__name__)


async def check_reachable(directory: PeerDirectory, *, address: str, peer_id: str, num_stages: int, run_id: str,
                          timeout_s: float, identity=None) -> None:
    """Ask up to four live peers to dial `address` (our health endpoint); raise UnreachableAddress
    only when peers answered and none could reach us (a first node, with nobody to ask, passes)."""
    from noloco_node.rpc.diagnostics import probe_from_peers

    peers = [r.address for s in range(num_stages) for r in await directory.replicas(s, fresh=True) if r.peer_id != peer_id]
    random.Random(peer_id).shuffle(peers)
    results, errors = await probe_from_peers(address, peers[:4], run_id=run_id, timeout_s=timeout_s, identity=identity)
    if results and not any(r.reachable for r in results):
        details = "; ".join(f"{r.prober}: {r.detail}" for r in results)
        raise UnreachableAddress(f"no peer could reach this node at {address} ({details})")
    if errors and not results:
        log.warning("could not ask any peer to check our address: %s", "; ".join(errors))


async def fetch_state(directory: PeerDirectory, client: OuterClient, compute: ComputeThread, state: OuterState,
                      inner: InnerOptimizer, *, stage: int, peer_id: str, timeout_s: float) -> dict | None:
    """Joining a stage that already has replicas: copy a random one's phi, m, Adam moments and
    counters (theta <- phi). Up to 3 donors are tried. Returns {donor, inner_step, outer_round},
    or None (no other replica, or none answered: the run's initial weights stay)."""
    donors = [r for r in await directory.replicas(stage, fresh=True) if r.peer_id != peer_id]
    random.Random(peer_id).shuffle(donors)
    for donor in donors[:3]:
        try:
            tensors, counters = await client.fetch_state(donor.address, stage=stage, peer_id=peer_id, timeout_s=timeout_s,
                                                         expected=expected_tensors(state))
            step = await compute.run(import_state, state, inner, tensors, counters)
        except NodeError as exc:
            log.warning("state transfer from %s failed: %s", donor.peer_id[-8:], exc)
            continue
        outer_round = int(counters["outer_round"])
        log.info("joined at inner step %d, outer round %d with state from %s", step, outer_round, donor.peer_id[-8:])
        return {"donor": donor.peer_id, "inner_step": step, "outer_round": outer_round}
    if donors:
        log.warning("no donor answered; starting from the run's initial weights")
    return None
