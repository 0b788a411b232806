"""How many Outer.FetchState streams a donor serves at once (rpc/state_service.py).

Each open stream holds its own copy of the stage state it sends (taken on the compute thread so
that it is consistent, then encoded tensor by tensor), and a reader that takes one message within
every progress deadline keeps its stream open for as long as the total deadline allows. Unbounded,
a few identities held 64 streams (the server's cap on concurrent calls) and 1.0 GB of copies of an
11.6 MB state on the tiny preset; a real stage is GBs per copy. So a donor serves at most
`MAX_STREAMS` at once, `MAX_STREAMS_PER_CALLER` of them for one caller (a joiner asks each donor
for one part at a time), and answers more with RESOURCE_EXHAUSTED (`peer-busy`): an honest joiner
asks another donor, or this one again a little later (sync/state_fetch.py)."""

from __future__ import annotations

from collections import Counter

from noloco_node.errors import PeerBusy

MAX_STREAMS = 2
"""FetchState streams one donor serves at once, all callers together (each holds a copy of the
part of the state it sends)."""
MAX_STREAMS_PER_CALLER = 1
"""FetchState streams one donor serves one caller at once."""


class StreamSlots:
    """The FetchState streams open now, per caller."""

    def __init__(self, *, total: int = MAX_STREAMS, per_caller: int = MAX_STREAMS_PER_CALLER) -> None:
        self.total, self.per_caller = total, per_caller
        self.open: Counter[str] = Counter()

    def take(self, caller: str) -> None:
        """A slot for one stream to `caller`; raises PeerBusy when none is free. Give it back with `give`."""
        if self.open[caller] >= self.per_caller:
            raise PeerBusy(
                f"{self.open[caller]} state transfer(s) to {caller[-8:]} already running; this donor serves "
                f"{self.per_caller} per caller at once: wait for it to end"
            )
        if sum(self.open.values()) >= self.total:
            raise PeerBusy(
                f"this donor already serves {self.total} state transfers, its most at once: ask another donor, "
                "or this one again later"
            )
        self.open[caller] += 1

    def give(self, caller: str) -> None:
        self.open[caller] -= 1
        if self.open[caller] <= 0:
            del self.open[caller]
