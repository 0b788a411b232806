"""What one peer may cost this node: a token-bucket rate, a cap on its concurrent calls, and
bans with exponential backoff for peers that keep sending invalid data. Pure bookkeeping (no
gRPC): the admission interceptor asks it before every call and tells it how the call ended.

Memory is bounded whatever peers do: at most `max_peers` identities are tracked (least recently
seen forgotten first), so an attacker rotating identities cannot grow these tables.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _PeerState:
    tokens: float
    refilled_at: float
    active: int = 0
    invalid: int = 0
    bans: int = 0
    banned_until: float = 0.0


@dataclass
class GuardStats:
    rate_limited: int = 0
    over_stream_cap: int = 0
    refused_banned: int = 0
    bans: int = 0
    invalid: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GuardLimits:
    """What one peer may cost this node (security.peer_* and security.ban_*)."""

    requests_per_s: float
    burst: int
    """The token bucket's size: calls a peer may make at once before the rate applies."""
    max_streams: int
    """Calls of one peer in progress at once."""
    ban_after_invalid: int
    """Invalid calls before a ban."""
    ban_s: float
    """The first ban's length; each next one doubles, up to `ban_max_s`."""
    ban_max_s: float
    ban_after_poisoned: int = 1
    """Poisoned payloads (non-finite, out of bounds) before a ban."""
    max_peers: int = 4096
    """Identities tracked at once (the least recently seen forgotten first)."""


class PeerGuard:
    def __init__(self, limits: GuardLimits, *, clock=time.monotonic) -> None:
        self.rate, self.burst, self.max_streams = limits.requests_per_s, limits.burst, limits.max_streams
        self.ban_after, self.ban_s, self.ban_max_s = limits.ban_after_invalid, limits.ban_s, limits.ban_max_s
        self.ban_after_poisoned = limits.ban_after_poisoned
        self.max_peers, self.clock = limits.max_peers, clock
        self._peers: OrderedDict[str, _PeerState] = OrderedDict()
        self.stats = GuardStats()

    def _state(self, peer: str) -> _PeerState:
        state = self._peers.get(peer)
        if state is None:
            # Forget idle peers first; one with calls in progress is kept until they end.
            while len(self._peers) >= self.max_peers:
                victim = next(
                    (p for p, s in self._peers.items() if s.active == 0 and s.banned_until <= self.clock()),
                    next(iter(self._peers)),
                )
                del self._peers[victim]
            state = self._peers[peer] = _PeerState(tokens=float(self.burst), refilled_at=self.clock())
        else:
            self._peers.move_to_end(peer)
        return state

    def admit(self, peer: str) -> str | None:
        """None if `peer` may start a call now (counted as active until `finish`), else why not."""
        now = self.clock()
        state = self._state(peer)
        if state.banned_until > now:
            self.stats.refused_banned += 1
            return f"banned for {state.banned_until - now:.0f} s more after repeated invalid messages"
        state.tokens = min(float(self.burst), state.tokens + (now - state.refilled_at) * self.rate)
        state.refilled_at = now
        if state.tokens < 1.0:
            self.stats.rate_limited += 1
            return f"rate limit of {self.rate:g} calls/s exceeded"
        if state.active >= self.max_streams:
            self.stats.over_stream_cap += 1
            return f"{state.active} calls already in progress (limit {self.max_streams})"
        state.tokens -= 1.0
        state.active += 1
        return None

    def finish(self, peer: str, invalid: str | None = None, *, at_once: bool = False) -> float | None:
        """End a call admitted earlier; `invalid` names the reason when the peer sent bad data.
        Returns the ban length in seconds when this call earned the peer a ban."""
        state = self._peers.get(peer)
        if state is None:
            return None
        state.active = max(0, state.active - 1)
        if invalid is None:
            return None
        return self.strike(peer, invalid, at_once=at_once)

    def strike(self, peer: str, reason: str, *, at_once: bool = False) -> float | None:
        """Count an invalid message; `at_once` (values that would corrupt us) bans after
        `ban_after_poisoned` strikes (by default on the first) instead of `ban_after_invalid`."""
        state = self._state(peer)
        self.stats.invalid[reason] = self.stats.invalid.get(reason, 0) + 1
        state.invalid += 1
        if state.invalid < (self.ban_after_poisoned if at_once else self.ban_after):
            return None
        state.invalid = 0
        state.bans += 1
        duration = min(self.ban_max_s, self.ban_s * 2 ** (state.bans - 1))
        state.banned_until = self.clock() + duration
        self.stats.bans += 1
        return duration

    def banned(self) -> int:
        now = self.clock()
        return sum(1 for s in self._peers.values() if s.banned_until > now)

    def tracked(self) -> int:
        return len(self._peers)
