"""Each peer's link as this node's own traffic measures it, and the deadlines that follow from it.

A node times every transfer it makes or receives anyway (Forward/Backward calls, outer exchanges,
state fetches). Per peer and direction it keeps an exponential moving average of bytes per second
from transfers large enough that the payload, not the round trip, sets their time
(`min_sample_bytes`), and an average round-trip time from the small ones.

A transfer's deadline is then the payload's time at that peer's rate, times a slack, plus two
round trips, held between a floor (the configured fixed deadline of that kind of call, so nothing
gets less time than before) and a ceiling. A peer not measured yet gets the slower of the
configured assumed rate and the median of the peers measured so far (this node's own link is
often the bottleneck), so a first large transfer over a slow link does not time out either.

A long total deadline must not keep a dead peer: a transfer also has a progress deadline, cut
when no message arrives (or leaves) for `stall_s`, or for one message's time at the rate times
the slack where that is longer.

Pure bookkeeping: no networking, no models; callers pass the sizes and seconds they measured.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

SENT, RECEIVED = "sent", "received"
MESSAGE_BYTES = 1 << 20  # the largest message a transfer waits for at once (rpc/tensors.py CHUNK_BYTES)


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else alpha * sample + (1 - alpha) * old


@dataclass
class _Link:
    sent: float | None = None  # bytes/s of what we sent to the peer
    received: float | None = None  # bytes/s of what we received from it
    rtt_s: float | None = None
    samples: int = 0
    touched: int = 0  # when it was last updated, for forgetting the stalest peer


class LinkEstimates:
    """Per peer: bytes/s each way and the round-trip time, from this node's own transfers."""

    def __init__(self, *, alpha: float = 0.3, min_sample_bytes: int = 16 * 1024, max_peers: int = 1024) -> None:
        """`min_sample_bytes`: the smallest transfer taken as a bandwidth sample. Low on purpose: a
        small hop whose time the round trip dominates reads as a slower link, which only lengthens
        deadlines, while a threshold above a run's hop size measured nothing at all (seen: int4 hops
        of 33 KB on a 0.6 Mbit/s link left every peer at timeouts.assumed_mbit_s, and the state
        fetch and every exchange were cut at their floors)."""
        if not 0 < alpha <= 1 or min_sample_bytes < 1 or max_peers < 1:
            raise ValueError("alpha must be in (0, 1], min_sample_bytes and max_peers >= 1")
        self.alpha, self.min_sample_bytes, self.max_peers = alpha, min_sample_bytes, max_peers
        self._links: dict[str, _Link] = {}
        self._clock = 0

    def _link(self, peer_id: str) -> _Link:
        self._clock += 1
        link = self._links.get(peer_id)
        if link is None:
            if len(self._links) >= self.max_peers:  # peers come and go: forget the one heard from longest ago
                del self._links[min(self._links, key=lambda p: self._links[p].touched)]
            link = self._links[peer_id] = _Link()
        link.touched = self._clock
        return link

    def observe(self, peer_id: str, payload_bytes: int, seconds: float, direction: str) -> None:
        """One transfer of `payload_bytes` to (SENT) or from (RECEIVED) `peer_id` took `seconds`.
        A small one is a round-trip sample; a large one a bandwidth sample, from its time less one
        round trip (never less than half of it, so a noisy RTT cannot make the rate soar)."""
        if direction not in (SENT, RECEIVED):
            raise ValueError(f"direction must be {SENT!r} or {RECEIVED!r}, got {direction!r}")
        if not seconds > 0 or payload_bytes < 0:
            return
        link = self._link(peer_id)
        if payload_bytes < self.min_sample_bytes:
            link.rtt_s = _ewma(link.rtt_s, seconds, self.alpha)
            return
        transfer_s = max(seconds - (link.rtt_s or 0.0), seconds / 2)
        setattr(link, direction, _ewma(getattr(link, direction), payload_bytes / transfer_s, self.alpha))
        link.samples += 1

    def observe_rtt(self, peer_id: str, seconds: float) -> None:
        """A round trip that carried (next to) no payload: a request and its reply."""
        if seconds > 0:
            link = self._link(peer_id)
            link.rtt_s = _ewma(link.rtt_s, seconds, self.alpha)

    def bytes_per_s(self, peer_id: str, direction: str | None = None) -> float | None:
        """The measured rate to (SENT) or from (RECEIVED) the peer, the other direction's where only
        that one is measured; `direction` None: the slower of the two (a transfer both ways).
        None before any bandwidth sample."""
        link = self._links.get(peer_id)
        if link is None:
            return None
        known = [r for r in (link.sent, link.received) if r is not None]
        if not known:
            return None
        if direction is not None and getattr(link, direction) is not None:
            return getattr(link, direction)
        return min(known)

    def rtt_s(self, peer_id: str) -> float | None:
        link = self._links.get(peer_id)
        return None if link is None else link.rtt_s

    def median_bytes_per_s(self) -> float | None:
        """The median over measured peers of each one's slower direction; None before any."""
        rates = [r for r in (self.bytes_per_s(p) for p in self._links) if r is not None]
        return statistics.median(rates) if rates else None

    def link_mbit_s(self) -> float:
        """What this node announces: the median measured rate in Mbit/s; 0 = not measured yet."""
        median = self.median_bytes_per_s()
        return 0.0 if median is None else median * 8 / 1e6

    def summary(self) -> dict[str, dict[str, float]]:
        """Per peer: Mbit/s each way (0 = not measured), RTT in ms, bandwidth samples."""
        return {
            peer: {
                "sent_mbit_s": round((link.sent or 0.0) * 8 / 1e6, 3),
                "received_mbit_s": round((link.received or 0.0) * 8 / 1e6, 3),
                "rtt_ms": round((link.rtt_s or 0.0) * 1e3, 2),
                "samples": link.samples,
            }
            for peer, link in self._links.items()
        }


@dataclass(frozen=True)
class DeadlinePolicy:
    """How a transfer's size and a link's rate become deadlines (config: the [timeouts] section)."""

    assumed_bytes_per_s: float = 5e6 / 8
    """The rate taken for a peer nobody has measured yet (timeouts.assumed_mbit_s)."""
    slack: float = 3.0
    """A transfer gets this many times its time at the measured rate (timeouts.deadline_slack)."""
    ceiling_s: float = 3600.0
    """No derived deadline is longer (timeouts.deadline_ceiling_s)."""
    stall_s: float = 10.0
    """Progress deadline: no message for this long ends a transfer (timeouts.stall_s)."""

    def __post_init__(self) -> None:
        if not (self.assumed_bytes_per_s > 0 and self.slack >= 1 and self.ceiling_s > 0 and self.stall_s > 0):
            raise ValueError(f"invalid deadline policy {self}: rates and seconds must be > 0, slack >= 1")

    @classmethod
    def from_timeouts(cls, timeouts) -> DeadlinePolicy:
        """From a [timeouts] config section (config/sections.py TimeoutsConfig)."""
        return cls(
            assumed_bytes_per_s=timeouts.assumed_mbit_s * 1e6 / 8,
            slack=timeouts.deadline_slack,
            ceiling_s=timeouts.deadline_ceiling_s,
            stall_s=timeouts.stall_s,
        )

    def transfer_s(self, payload_bytes: int, bytes_per_s: float | None) -> float:
        """The payload's time at the rate (the assumed one when None), times the slack."""
        return self.slack * payload_bytes / (bytes_per_s or self.assumed_bytes_per_s)

    def total_s(
        self, payload_bytes: int, *, floor_s: float, bytes_per_s: float | None = None, rtt_s: float | None = None
    ) -> float:
        """max(floor, slack x bytes / rate + 2 RTT), at most the ceiling (or the floor, if higher)."""
        need = self.transfer_s(payload_bytes, bytes_per_s) + 2 * (rtt_s or 0.0)
        return max(floor_s, min(self.ceiling_s, need))

    def stall_after_s(self, bytes_per_s: float | None = None, message_bytes: int = MESSAGE_BYTES) -> float:
        """Progress deadline: stall_s, or one whole message's time at the rate where that is longer."""
        return min(max(self.stall_s, self.transfer_s(message_bytes, bytes_per_s)), max(self.ceiling_s, self.stall_s))


@dataclass(frozen=True)
class LinkDeadlines:
    """One kind of call's deadlines towards any peer: the policy applied to that peer's estimates,
    never under `floor_s` (that call's configured fixed deadline)."""

    estimates: LinkEstimates = dataclasses.field(default_factory=LinkEstimates)
    policy: DeadlinePolicy = DeadlinePolicy()
    floor_s: float = 0.0

    def floored(self, floor_s: float) -> LinkDeadlines:
        """The same estimates and policy for a kind of call whose fixed deadline is `floor_s`."""
        return dataclasses.replace(self, floor_s=floor_s)

    def rate(self, peer_id: str, direction: str | None = None) -> float:
        """The peer's measured rate; before any, the slower of the assumed rate and our median."""
        measured = self.estimates.bytes_per_s(peer_id, direction)
        if measured is not None:
            return measured
        median = self.estimates.median_bytes_per_s()
        assumed = self.policy.assumed_bytes_per_s
        return assumed if median is None else min(assumed, median)

    def total_s(self, peer_id: str, payload_bytes: int, direction: str | None = None) -> float:
        return self.policy.total_s(
            payload_bytes,
            floor_s=self.floor_s,
            bytes_per_s=self.rate(peer_id, direction),
            rtt_s=self.estimates.rtt_s(peer_id),
        )

    def transfer_s(self, peer_id: str, payload_bytes: int, direction: str | None = None) -> float:
        """slack x bytes / the peer's rate, with no floor (for deadlines that add their own)."""
        return min(self.policy.ceiling_s, self.policy.transfer_s(payload_bytes, self.rate(peer_id, direction)))

    def stall_s(self, peer_id: str, direction: str | None = None) -> float:
        return self.policy.stall_after_s(self.rate(peer_id, direction))
