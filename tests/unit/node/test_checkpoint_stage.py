"""`--stage auto` with a checkpoint: back to its stage when the swarm needs it there (nobody serves it,
or its replicas are not past it and no other stage is empty), else the stage chosen by need."""

from types import SimpleNamespace

import torch

from noloco_node.config import build_config
from noloco_node.node.checkpoint import save
from noloco_node.node.discovery import _checkpoint_stage

IDENTITY = {"run_id": "local", "manifest_hash": "m1", "peer_id": "QmMe"}


class Swarm:
    peer_id = "QmMe"

    def __init__(self, steps_per_stage: dict[int, list[int]]) -> None:
        self.steps = steps_per_stage

    async def replicas(self, stage: int, *, fresh: bool = False) -> list:
        return [SimpleNamespace(peer_id=f"Qm{stage}{i}", inner_step=s) for i, s in enumerate(self.steps.get(stage, []))]


async def test_the_checkpoint_stage_when_needed_there_else_none(tmp_path):
    save(tmp_path, 1, {"theta/w": torch.zeros(1)}, {"inner_step": 40, "outer_round": 0}, IDENTITY)
    cfg = build_config({"checkpoint": {"dir": str(tmp_path)}, "outer": {"inner_steps_per_outer": 5}})

    async def stage_for(steps: dict[int, list[int]], manifest: str = "m1"):
        return await _checkpoint_stage(cfg, manifest, Swarm(steps))

    assert await stage_for({0: [50]}) == 1  # nobody serves stage 1
    assert await stage_for({0: [50], 1: [45]}) == 1  # served, within 2 rounds of 5 steps
    assert await stage_for({0: [50], 1: [51]}) is None  # more than 10 steps past the checkpoint
    assert await stage_for({1: [45]}) is None  # served while stage 0 is empty
    assert await stage_for({0: [50]}, manifest="m2") is None  # another manifest's checkpoint
