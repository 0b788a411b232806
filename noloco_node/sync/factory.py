"""One factory for the outer-sync method a node runs (`outer.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.config import NodeConfig
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.worker import StageWorker
from noloco_node.sync.diloco import AllReduce
from noloco_node.sync.ports import (MatchingDirectory, NoSync, OuterSync, PairingTransport, StageProgress,
                                    SyncParts)


@dataclass(frozen=True)
class SyncPorts:
    """The network ports a method may need; each method takes the ones it uses."""

    pairing: PairingTransport | None = None
    matching: MatchingDirectory | None = None
    all_reduce: AllReduce | None = None
    progress: StageProgress | None = None


def needs_outer_state(method: str) -> bool:
    """Methods that keep slow weights phi and outer momentum m."""
    return method in ("noloco", "diloco")


def build_outer_sync(config: NodeConfig, parts: SyncParts, ports: SyncPorts, *, worker: StageWorker,
                     state: OuterState | None) -> OuterSync:
    outer, timeouts = config.outer, config.timeouts
    allreduce_s = timeouts.outer_round_s
    if outer.method == "noloco":
        from noloco_node.sync.noloco import NoLoCoSync

        return NoLoCoSync(state, outer, parts, transport=ports.pairing, directory=ports.matching,
                          match_s=timeouts.match_s, run_seed=config.run.seed)
    if outer.method == "diloco":
        from noloco_node.sync.diloco import DiLoCoSync

        return DiLoCoSync(state, outer, parts, all_reduce=ports.all_reduce, timeout_s=allreduce_s)
    if outer.method == "dp":
        from noloco_node.sync.dp import DataParallelSync

        # A round short of members is tried again for up to 3/4 of the microbatch timeout (sync/dp.py).
        return DataParallelSync(worker, outer, parts, all_reduce=ports.all_reduce, progress=ports.progress,
                                timeout_s=allreduce_s, patience_s=0.75 * timeouts.microbatch_s)
    return NoSync()
