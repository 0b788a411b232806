"""A finished run reads as finished, not broken: once stage 0's replicas trained all of
inner.total_steps, a later stage's node says so once and stops warning of a stall, and the
swarm's JSON (status, the pages) says the run is finished first. A newcomer read "no inner step
for 8 min ... see doctor" on every stage-1 node, `status` and both pages of a finished run."""

import logging
from types import SimpleNamespace

from noloco_node.config import load_config
from noloco_node.dashboard.swarm import swarm_json
from noloco_node.node.attention import NodeView, attention
from noloco_node.node.presence import _notice_a_finished_run

CONFIG = load_config(
    overrides=["run.run_id=fin", "inner.total_steps=400", "inner.warmup_steps=40", "pipeline.num_stages=2"]
)


class Directory:
    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    async def replicas(self, stage: int, *, fresh: bool = False):
        assert stage == 0
        return [SimpleNamespace(inner_step=s) for s in self.steps]


def node(steps: list[int]) -> SimpleNamespace:
    return SimpleNamespace(config=CONFIG, directory=Directory(steps), run_finished_at=None)


async def test_a_later_stage_notices_once_stage_0_trained_every_step(caplog):
    for steps in ([], [400, 399], [120]):
        idle = node(steps)
        await _notice_a_finished_run(idle)
        assert idle.run_finished_at is None, steps
    done = node([400, 412])
    with caplog.at_level(logging.INFO):
        await _notice_a_finished_run(done)
    assert done.run_finished_at == 400
    assert "the run is finished: stage 0's replicas trained all 400 inner steps" in caplog.text


def test_a_done_node_is_not_stalled():
    view = dict(stage=1, rounds_go_solo=True, all_reduce=False, replicas_of_stage=2, outer_history=[])
    assert "no inner step" in attention(NodeView(**view, since_progress_s=600.0))[0]
    assert attention(NodeView(**view, since_progress_s=600.0, done=True)) == []


def row(peer: str, stage: int, inner_step: int, status: str = "serving") -> dict:
    return {
        "peer_id": peer,
        "stage": stage,
        "inner_step": inner_step,
        "status": status,
        "capacity": 1.0,
        "tokens_per_s": 0.0,
        "manifest_hash": "m" * 16,
        "reach": "direct",
        "updated_at": 1000.0,
        "seen_s_ago": 1.0,
        "attention": [],
    }


def test_the_swarm_says_the_run_is_finished_first():
    finished = swarm_json([row("a", 0, 400), row("b", 0, 401), row("c", 1, 399)], CONFIG, now=1000.0)
    assert finished["finished"] is True
    assert finished["attention"][0].startswith("the run is finished: stage 0's replicas trained all 400 inner steps")
    # One stage-0 replica still training (a leaving one does not count), or none at all: not finished.
    for rows in ([row("a", 0, 400), row("b", 0, 380)], [row("c", 1, 10)]):
        assert swarm_json(rows, CONFIG, now=1000.0)["finished"] is False
    leaving = swarm_json([row("a", 0, 400), row("b", 0, 30, status="leaving")], CONFIG, now=1000.0)
    assert leaving["finished"] is True
