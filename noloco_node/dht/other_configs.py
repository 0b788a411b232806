"""Peers of our run whose records carry another manifest: a config that is not the swarm's (theirs
or ours), which node/attention.py names while a node waits for a replica. A peer counts while
lookups keep finding it live: one that left stops counting (a newcomer's node kept warning of a
mismatched peer 90 s after it had gone, and in its closing summary)."""

from __future__ import annotations

import time

from noloco_node.dht.records import StageRecord
from noloco_node.runtime.node_status import Status

SEEN_S = 60.0
"""How long a peer of another config counts after a lookup last found it: two record TTLs (30 s),
several lookups of a node waiting for a replica (it looks around every few seconds)."""
MAX_PEERS = 4096


class OtherConfigs:
    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, float]] = {}  # peer -> (manifest, when last found live)

    def found(self, record: StageRecord) -> None:
        """A lookup found `record`, whose manifest is not ours."""
        if record.status == Status.LEAVING:
            self._seen.pop(record.peer_id, None)
        elif len(self._seen) < MAX_PEERS or record.peer_id in self._seen:
            self._seen[record.peer_id] = (record.manifest_hash, time.monotonic())

    def peers(self, seen_s: float | None = None) -> dict[str, str]:
        """peer -> manifest, of those found live within the last `seen_s` (default SEEN_S)."""
        since = time.monotonic() - (SEEN_S if seen_s is None else seen_s)
        self._seen = {p: seen for p, seen in self._seen.items() if seen[1] >= since}
        return {peer: manifest for peer, (manifest, _) in self._seen.items()}
