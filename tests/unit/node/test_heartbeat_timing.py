"""The heartbeat renews our record on time whatever the DHT's other calls take: in a soak, a
SIGSTOPped peer made the lookups and stores of healthy replicas wait, and their records were 4-7 s
old against an 8 s lifetime (the lookup, the store and the sleep took turns)."""

import asyncio
import time
from types import SimpleNamespace

from noloco_node.node.presence import MAX_ANNOUNCING, heartbeat

PERIOD_S = 0.1


class HungDirectory:
    """Every lookup waits as one on a hung peer does."""

    async def replicas(self, stage: int, *, fresh: bool = False) -> list:
        await asyncio.sleep(3600)
        return []

    async def keep_in_touch(self) -> None:
        return None


def node(announce_s: float, started: list[float]) -> SimpleNamespace:
    async def announce() -> None:
        started.append(time.monotonic())
        await asyncio.sleep(announce_s)

    tasks = set()

    def spawn(coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        return task

    async def expire_saved() -> None:
        return None

    return SimpleNamespace(
        stopping=False,
        config=SimpleNamespace(
            timeouts=SimpleNamespace(heartbeat_s=PERIOD_S), pipeline=SimpleNamespace(max_in_flight=4, num_stages=2)
        ),
        meter=SimpleNamespace(sample=lambda **_: None),
        worker=SimpleNamespace(sequences_total=0),
        parts=SimpleNamespace(compute=SimpleNamespace(busy_s=0.0)),
        runtime=SimpleNamespace(in_flight={}, expire_saved=expire_saved),
        progress=SimpleNamespace(since_progress_s=lambda: 0.0, waiting_for=None),
        stage_replicas=2,
        stage_index=0,
        directory=HungDirectory(),
        announce=announce,
        spawn=spawn,
        reprobe=None,
        links=SimpleNamespace(reach="direct", bridge=None),
        tasks=tasks,
    )


def run_heartbeat(fake, seconds: float) -> None:
    async def main():
        task = asyncio.ensure_future(heartbeat(fake))
        await asyncio.sleep(seconds)
        task.cancel()
        for t in (task, *fake.tasks):
            t.cancel()
        await asyncio.gather(task, *fake.tasks, return_exceptions=True)

    asyncio.run(main())


def test_the_record_is_renewed_every_period_while_a_lookup_hangs():
    started: list[float] = []
    run_heartbeat(node(announce_s=0.0, started=started), 30 * PERIOD_S)
    assert len(started) >= 10, started  # one a period, the hung lookup notwithstanding
    gaps = [b - a for a, b in zip(started, started[1:])]
    assert max(gaps) < 10 * PERIOD_S, gaps


def test_stores_that_wait_on_a_hung_peer_overlap_at_most_so_many():
    started: list[float] = []
    run_heartbeat(node(announce_s=3600.0, started=started), 10 * PERIOD_S)
    assert len(started) == MAX_ANNOUNCING
