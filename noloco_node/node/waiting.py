"""What a node waits for before it can train: live replicas of the stages around it."""

from __future__ import annotations

from collections.abc import Callable

from noloco_node.dht.directory import PeerDirectory


async def wait_for_replicas(
    directory: PeerDirectory,
    stages: range,
    count: int,
    waiting: Callable[[str | None], None],
    poll_s: float = 0.5,
    me: tuple[int, str] | None = None,
) -> None:
    """Block until each of `stages` shows at least `count` live replicas, however long that takes (in
    a volunteer swarm someone is always first); meanwhile `waiting(what)` says which stage is short,
    and `waiting(None)` once none is. `me` (stage, peer id) counts for its stage before its own
    record shows (a resumed stage-0 node said it waited for a stage-0 replica)."""
    import asyncio

    def size(stage: int, records) -> int:
        ours = {me[1]} if me is not None and me[0] == stage else set()
        return len({r.peer_id for r in records} | ours)

    fresh = False  # first from the lookup cache: stage 0 asks before every batch
    while True:
        sizes = {s: size(s, await directory.replicas(s, fresh=fresh)) for s in stages}
        short = [s for s, n in sizes.items() if n < count]
        if not short:
            waiting(None)
            return
        fresh = True
        s = short[0]
        have = f" (has {sizes[s]})" if sizes[s] else ""
        waiting(f"a stage-{s} replica{have}" if count == 1 else f"{count} replicas of stage {s}{have}")
        await asyncio.sleep(poll_s)


async def look_around(directory: PeerDirectory, stage: int, num_stages: int) -> tuple[int, str | None]:
    """(live replicas of `stage`, ours included; 'a stage-S replica' for a neighbouring stage with
    none, the next one first, else None)."""
    ours = len(await directory.replicas(stage, fresh=True))
    for neighbour in (stage + 1, stage - 1):
        if 0 <= neighbour < num_stages and not await directory.replicas(neighbour, fresh=True):
            return ours, f"a stage-{neighbour} replica"
    return ours, None
