"""What a stage's runtime keeps per microbatch in flight (its ticket) and counts of its traffic."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import Tensor

from noloco_node.pipeline.ports import Hop, MicrobatchKey


@dataclass
class Ticket:
    key: MicrobatchKey
    route: list[Hop]
    labels: Tensor | None = None
    token_ids: Tensor | None = None
    loss: float = 0.0
    num_tokens: int = 0
    downstream: str = ""  # the replica that accepted our forward: the only one whose gradient we take
    sent_to: set[str] = field(default_factory=set)  # every replica a forward of it went to

    def gradient_may_come_from(self, caller: str) -> bool:
        """The replica that accepted our forward; before an accept is seen (or when none was: each
        call failed, one maybe after it delivered), any replica we forwarded it to."""
        return caller == self.downstream if self.downstream else caller in self.sent_to


@dataclass
class RuntimeStats:
    forwards_received: Counter = field(default_factory=Counter)  # upstream peer id -> count
    forwards_sent: int = 0
    backwards_sent: int = 0
    send_failures: int = 0
    dropped_here: int = 0
    expired: int = 0
    busy_answers: int = 0
    routed_balanced: int = 0  # forwards sent to the balanced (permutation) or fixed choice
    routed_random: int = 0  # forwards sent to a random choice (random routing, fallback or retry)
    routed_to: Counter = field(default_factory=Counter)  # next-stage peer id -> forwards it accepted
