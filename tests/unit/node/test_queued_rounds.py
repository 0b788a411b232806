"""A later stage's boundaries run in the background of its steps, one at a time: behind a round that
took longer than H inner steps they queue, and each queued round then ran at once with nothing
trained since the one before (a model audit saw rounds 30-33 within a second after a resume;
solo, each applied the outer momentum again). A pair round that a later queued one supersedes is
left out; steps between rounds, and methods that round as a group, are untouched."""

import asyncio
import logging
from types import SimpleNamespace

from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.runtime.events import EventLog

H = 5


class SlowFirstRound:
    """The first round it runs waits for `release`; every call is recorded."""

    def __init__(self, pairs: bool) -> None:
        self.pairs, self.release, self.calls = pairs, asyncio.Event(), []

    def may_skip_round(self, inner_step: int) -> bool:
        return self.pairs and inner_step % H == 0

    async def at_boundary(self, inner_step: int) -> None:
        self.calls.append(inner_step)
        if inner_step == H:
            await self.release.wait()


def boundary_calls(tmp_path, pairs: bool) -> list[int]:
    async def main() -> list[int]:
        sync = SlowFirstRound(pairs)
        events = EventLog(tmp_path / f"events-{pairs}.jsonl")
        boundary = InnerStepBoundary(
            worker=SimpleNamespace(inner_steps=0, last_lr=0.0, tokens_total=0),
            sync=sync,
            events=events,
            compute=SimpleNamespace(idle_s=0.0, busy_s=0.0),
            stage_index=1,
            bytes_sent=lambda: 0,
        )
        first = asyncio.ensure_future(boundary(H))
        await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(boundary(step)) for step in range(H + 1, 4 * H + 1)]  # steps 6..20
        await asyncio.sleep(0.01)
        sync.release.set()
        await asyncio.gather(first, *queued)
        events.close()
        return sync.calls

    return asyncio.run(main())


def test_queued_pair_rounds_collapse_to_the_latest(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="noloco_node.node.boundary"):
        calls = boundary_calls(tmp_path, pairs=True)
    assert calls == [H, *range(H + 1, 2 * H), *range(2 * H + 1, 3 * H), *range(3 * H + 1, 4 * H + 1)], calls
    assert 2 * H not in calls and 3 * H not in calls and 4 * H in calls
    assert "outer round of inner step 10 left out: the round of inner step 20 is due already" in caplog.text


def test_group_rounds_are_never_left_out(tmp_path):
    assert boundary_calls(tmp_path, pairs=False) == list(range(H, 4 * H + 1))
