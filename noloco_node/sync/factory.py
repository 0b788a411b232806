"""One factory for the outer-sync method a node runs (`outer.method`), and the method's traits
(`sync.ports.MethodTraits`) for the parts a node builds before it."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.config import NodeConfig
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.worker import StageWorker
from noloco_node.sync.ports import (
    AllReduce,
    MatchingDirectory,
    MethodTraits,
    NoSync,
    OuterSync,
    PairingTransport,
    StageProgress,
    SyncParts,
)


@dataclass(frozen=True)
class SyncPorts:
    """The network ports a method may need; each method takes the ones it uses."""

    pairing: PairingTransport | None = None
    matching: MatchingDirectory | None = None
    all_reduce: AllReduce | None = None
    progress: StageProgress | None = None


def _method_class(method: str) -> type[OuterSync]:
    if method == "noloco":
        from noloco_node.sync.noloco import NoLoCoSync

        return NoLoCoSync
    if method == "diloco":
        from noloco_node.sync.diloco import DiLoCoSync

        return DiLoCoSync
    if method == "dp":
        from noloco_node.sync.dp import DataParallelSync

        return DataParallelSync
    return NoSync


def method_traits(method: str) -> MethodTraits:
    """The traits of outer.method `method`: the ones its OuterSync will carry."""
    return _method_class(method).traits


def build_outer_sync(
    config: NodeConfig, parts: SyncParts, ports: SyncPorts, *, worker: StageWorker, state: OuterState | None
) -> OuterSync:
    outer, timeouts = config.outer, config.timeouts
    allreduce_s = timeouts.outer_round_s
    if outer.method == "noloco":
        from noloco_node.sync.noloco import NoLoCoSync
        from noloco_node.sync.pairing import NoLoCoSettings

        return NoLoCoSync(
            state,
            outer,
            parts,
            transport=ports.pairing,
            directory=ports.matching,
            settings=NoLoCoSettings(
                match_s=timeouts.match_s, run_seed=config.run.seed, heartbeat_s=timeouts.heartbeat_s
            ),
        )
    if outer.method == "diloco":
        from noloco_node.sync.diloco import DiLoCoSync

        return DiLoCoSync(state, outer, parts, all_reduce=ports.all_reduce, timeout_s=allreduce_s)
    if outer.method == "dp":
        from noloco_node.sync.dp import DataParallelSync

        # A round short of members is tried again for up to 3/4 of the microbatch timeout (sync/dp.py).
        return DataParallelSync(
            worker,
            outer,
            parts,
            all_reduce=ports.all_reduce,
            progress=ports.progress,
            timeout_s=allreduce_s,
            patience_s=0.75 * timeouts.microbatch_s,
        )
    return NoSync()
