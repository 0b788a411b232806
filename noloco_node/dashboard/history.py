"""Bounded time series for the dashboards' charts, sampled by whoever owns them. Pure."""

from __future__ import annotations

import math
from collections import deque

HISTORY_POINTS = 720
"""Points kept per series: an hour at the default 5 s poll, and a page's JSON stays small."""
MAX_SERIES = 256
"""Replicas tracked per series family: records are bounded by the DHT, this bounds our memory too."""
HISTORY_SCHEMA = "noloco-node/history/1"
STEADY_CHANGES = 6
"""Inner-step changes a replica's points must show before a pause of it is judged against them."""


class Series:
    """Points ([time, *values]) in arrival order, the oldest dropped past `limit`."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        self.points: deque[list[float]] = deque(maxlen=limit)

    def add(self, at: float, *values: float) -> None:
        self.points.append([at, *values])

    @property
    def last(self) -> list[float] | None:
        return self.points[-1] if self.points else None

    def as_list(self) -> list[list[float]]:
        return list(self.points)


def _points(points, width: int) -> list[list[float]]:
    """Points of `width` finite numbers each, or ValueError."""
    if not isinstance(points, list):
        raise ValueError("a series must be a list of points")
    checked = []
    for point in points:
        if not isinstance(point, list) or len(point) != width:
            raise ValueError(f"a point must be a list of {width} numbers")
        values = [float(v) for v in point if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(values) != width or not all(math.isfinite(v) for v in values):
            raise ValueError(f"a point must be a list of {width} finite numbers")
        checked.append(values)
    return checked


class SwarmHistory:
    """The swarm page's series: the swarm's tokens/s, and each replica's loss and inner step, a
    replica's point added only when its record changed (a new `updated_at`)."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        self.limit = limit
        self.tokens_per_s = Series(limit)
        self.loss: dict[str, Series] = {}
        self.inner_step: dict[str, Series] = {}
        self._seen: dict[str, float] = {}

    def observe(self, at: float, replicas: list[dict], tokens_per_s: float) -> None:
        self.tokens_per_s.add(at, tokens_per_s)
        for row in replicas:
            peer, updated = row["peer_id"], row.get("updated_at", at)
            if self._seen.get(peer) == updated:
                continue
            if peer not in self._seen and len(self._seen) >= MAX_SERIES:
                self._forget_oldest()
            self._seen[peer] = updated
            self.inner_step.setdefault(peer, Series(self.limit)).add(updated, row["inner_step"])
            if row.get("loss") is not None:
                self.loss.setdefault(peer, Series(self.limit)).add(updated, row["inner_step"], row["loss"])

    def stalled_s(self, peer: str) -> tuple[float, float] | None:
        """(seconds from `peer`'s last inner-step change to its newest record, its median seconds
        between changes before), all on the replica's own clock (its records' updated_at: another
        machine's clock may be off); None while there are too few changes to tell."""
        series = self.inner_step.get(peer)
        points = series.as_list() if series is not None else []
        changes = [b[0] for a, b in zip(points, points[1:]) if b[1] != a[1]]
        if len(changes) < STEADY_CHANGES:
            return None
        gaps = sorted(b - a for a, b in zip(changes[-STEADY_CHANGES:], changes[-STEADY_CHANGES + 1 :]))
        return points[-1][0] - changes[-1], gaps[len(gaps) // 2]

    def _forget_oldest(self) -> None:
        oldest = min(self._seen, key=self._seen.get)
        for table in (self._seen, self.loss, self.inner_step):
            table.pop(oldest, None)

    @classmethod
    def from_json(cls, data: dict, limit: int = HISTORY_POINTS) -> SwarmHistory:
        """A history as `as_json` wrote it (a bootstrap's page keeps its charts across a restart);
        ValueError for anything else. At most `limit` points per series, MAX_SERIES replicas."""
        if not isinstance(data, dict) or data.get("schema") != HISTORY_SCHEMA:
            raise ValueError(f"not a {HISTORY_SCHEMA} document")
        history = cls(limit)
        for point in _points(data.get("tokens_per_s"), 2)[-limit:]:
            history.tokens_per_s.add(*point)
        for family, width in ((history.inner_step, 2), (history.loss, 3)):
            key = "inner_step" if family is history.inner_step else "loss"
            table = data.get(key)
            if not isinstance(table, dict):
                raise ValueError(f"{key} must be an object of series")
            for peer, points in list(table.items())[:MAX_SERIES]:
                series = family.setdefault(str(peer), Series(limit))
                for point in _points(points, width)[-limit:]:
                    series.add(*point)
        history._seen = {peer: series.last[0] for peer, series in history.inner_step.items() if series.last}
        return history

    def as_json(self) -> dict:
        return {
            "schema": HISTORY_SCHEMA,
            "tokens_per_s": self.tokens_per_s.as_list(),
            "loss": {peer: s.as_list() for peer, s in self.loss.items()},
            "inner_step": {peer: s.as_list() for peer, s in self.inner_step.items()},
        }


class NodeHistory:
    """A node page's series: its tokens/s, and its loss per inner step (stage 0)."""

    def __init__(self, limit: int = HISTORY_POINTS) -> None:
        self.tokens_per_s = Series(limit)
        self.loss = Series(limit)

    def observe(self, at: float, *, tokens_per_s: float, inner_step: int, loss: float | None) -> None:
        self.tokens_per_s.add(at, tokens_per_s)
        last = self.loss.last
        if loss is not None and (last is None or last[1] != inner_step or last[2] != loss):
            self.loss.add(at, inner_step, loss)

    def as_json(self) -> dict:
        return {
            "schema": "noloco-node/node-history/1",
            "tokens_per_s": self.tokens_per_s.as_list(),
            "loss": self.loss.as_list(),
        }
