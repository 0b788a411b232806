"""A top-up's encoding (the TOP_UP state encoding, rpc/state_service.py): the difference of a
donor's phi since what a joiner holds of it, and the donor's ledger of what each joiner holds.

A state copy at real size over a home uplink takes minutes while the donors train on, so the joiner
starts rounds behind its stage's replicas. phi moves only at outer steps and by little per round:
its difference travels int8 blockwise, about a ninth of the compact copy's bytes
(codec/state_layout.py). The donor records what the joiner holds after decoding, so the rounding
of one top-up is carried by the next. The joiner's side: sync/top_up.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from noloco_node.codec.state_layout import STATE_BLOCK, TOP_UP_CODEC
from noloco_node.codec.tensors import TensorSpec, decode, encode

KEEP_S = 900.0
"""How long a donor remembers what it sent a joiner: a joiner asks for its top-up as soon as its
copy is in, so this only has to outlast the other donors' parts of the same copy."""
MAX_JOINERS = 2
"""Joiners remembered at once: each costs the donor 4 bytes per parameter it sent that joiner, on
the host (a `medium` stage: up to 1.6 GB), so only two are kept (joiners of the same minute are
few). Past two, the newest stays (its top-up is the one to come: a joiner asks for it as soon as
its copy is in), and of the others the one holding the fewest bytes goes (the oldest of equals): a
caller that fetched one parameter cannot push out the larger of two joiners' bases, it would have
to receive more than that joiner did (ledger entries are written only for what a stream wrote
whole: rpc/state_service.py), and an honest joiner that copied a small part is kept though earlier
ones copied more (a hostile-peer audit saw every joiner's top-up refused in ordinary churn, its
part smaller than the two before it). A forgotten joiner's top-up is refused and its copy stays
as it was."""


class SentPhi:
    """Per joiner, the phi it holds of this donor's parameters (host tensors, float32)."""

    def __init__(
        self, *, keep_s: float = KEEP_S, max_joiners: int = MAX_JOINERS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keep_s, self.max_joiners, self.clock = keep_s, max_joiners, clock
        self._held: dict[str, tuple[float, dict[str, Tensor]]] = {}

    def record(self, joiner: str, parameter: str, phi: Tensor) -> None:
        """`joiner` now holds `phi` of `parameter` (a tensor nobody writes to afterwards)."""
        self.commit(joiner, {parameter: phi})

    def commit(self, joiner: str, holds: dict[str, Tensor]) -> None:
        """`joiner` now holds these phi (parameter -> tensor nobody writes to afterwards), beside
        what it held of other parameters; past `max_joiners`, of the joiners but this newest one,
        the one holding the fewest bytes is forgotten (the oldest of equals)."""
        self._expire()
        _, held = self._held.pop(joiner, (0.0, {}))
        held.update(holds)
        self._held[joiner] = (self.clock(), held)  # re-inserted: the newest last
        while len(self._held) > max(1, self.max_joiners):
            older = list(self._held)[:-1]
            smallest = min(older, key=lambda j: (self.held_bytes(j), older.index(j)))
            del self._held[smallest]

    def held(self, joiner: str, parameter: str) -> Tensor | None:
        self._expire()
        entry = self._held.get(joiner)
        return None if entry is None else entry[1].get(parameter)

    def held_bytes(self, joiner: str) -> int:
        """The bytes of phi `joiner` holds of ours (what eviction compares)."""
        entry = self._held.get(joiner)
        return 0 if entry is None else sum(t.numel() * t.element_size() for t in entry[1].values())

    def forget(self, joiner: str) -> None:
        self._held.pop(joiner, None)

    def joiners(self) -> list[str]:
        self._expire()
        return list(self._held)

    def _expire(self) -> None:
        now = self.clock()
        for joiner in [j for j, (at, _) in self._held.items() if now - at > self.keep_s]:
            del self._held[joiner]


def phi_difference(now: Tensor, held: Tensor) -> tuple[TensorSpec, bytes, Tensor]:
    """The top-up of one parameter: (spec, payload) of `now - held` in the top-up's codec, and the
    phi the joiner holds once it adds what it decodes (the donor records that)."""
    held = held.to(torch.float32)
    spec, payload = encode(now.to(torch.float32) - held, TOP_UP_CODEC, block_size=STATE_BLOCK)
    return spec, payload, held + decode(spec, payload)
