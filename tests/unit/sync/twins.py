"""A NoLoCo replica over the in-memory twins (pipeline/memory.py, sync/memory.py), for the tests
of how rounds pair: one float parameter, its inner steps read from a dict the test advances."""

import torch
from torch import nn

from noloco_node.config import OuterConfig
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.pipeline.router import Bans
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings
from noloco_node.sync.ports import SyncParts


def noloco_replica(
    name: str,
    network: MemoryNetwork,
    hub: MemoryPairingHub,
    steps: dict[str, int],
    *,
    every: int,
    settings: NoLoCoSettings,
) -> NoLoCoSync:
    """Replica `name` of stage 0, registered in `network` and `hub`; the caller shuts its compute down."""
    model = nn.Module()
    model.w = nn.Parameter(torch.ones(4))
    network.register(name, 0, None, inner_steps=lambda: steps[name])

    async def set_status(status: str, round_index: int) -> None:
        await network.set_status(name, status, round_index)

    parts = SyncParts(
        compute=ComputeThread(), peer_id=name, stage=0, set_status=set_status, inner_steps=lambda: steps[name]
    )
    sync = NoLoCoSync(
        OuterState(model.named_parameters(), alpha=0.5, beta=0.7),
        OuterConfig(codec="none", inner_steps_per_outer=every, overlap=True),
        parts,
        transport=hub.transport(name),
        directory=network.directory(),
        settings=settings,
        bans=Bans(),
    )
    hub.register(name, sync)
    return sync
