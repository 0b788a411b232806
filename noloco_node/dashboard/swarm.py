"""The swarm as its DHT records tell it: `swarm_json` (the JSON of `status --json` and of the
swarm page, docs/dashboard.md) and `SwarmView`, which reads the records for a page and keeps
their history. Nothing here trusts more than the records say: each was signed by the peer it
describes (dht/directory.py keeps only those), and a TLS certificate is shown by its fingerprint.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from noloco_node.config import NodeConfig
from noloco_node.dashboard.history import HISTORY_POINTS, SwarmHistory
from noloco_node.node.attention import swarm_attention
from noloco_node.runtime.files import atomic_write_text
from noloco_node.runtime.throughput import limiting_stage

log = logging.getLogger(__name__)
SCHEMA = "noloco-node/swarm/1"
ReadRecords = Callable[[int], Awaitable[Sequence]]
"""stage -> that stage's proven records (PeerDirectory.all_records)."""


def record_row(record, now: float) -> dict:
    """One replica as the JSON shows it: the record's fields, its certificate as a fingerprint,
    and how long ago it was written."""
    row = record.dict(exclude={"tls_cert"})
    row["tls_fingerprint"] = tls_fingerprint(record.tls_cert)
    row["seen_s_ago"] = max(0.0, now - record.updated_at)
    return row


def tls_fingerprint(cert_b64: str) -> str:
    """SHA-256 of the node's TLS certificate (what its clients pin), or "" without one."""
    try:
        return hashlib.sha256(base64.b64decode(cert_b64, validate=True)).hexdigest() if cert_b64 else ""
    except ValueError:
        return ""


async def read_rows(read: ReadRecords, num_stages: int, now: float | None = None) -> list[dict]:
    now = time.time() if now is None else now
    rows = []
    for stage in range(num_stages):
        rows.extend(record_row(r, now) for r in await read(stage))
    return rows


def swarm_json(rows: list[dict], config: NodeConfig, *, now: float | None = None) -> dict:
    """The swarm's state from its replicas' rows (`record_row`), for a page or a script."""
    num_stages = config.pipeline.num_stages
    stages = range(num_stages)
    manifest = swarm_manifest(rows)
    # A replica of another config never trains with the swarm: it gets its own note (manifest_notes),
    # not a place among its stage's replicas ("687 inner steps behind its stage", a newcomer read).
    ours = [r for r in rows if not (manifest and r["manifest_hash"] and r["manifest_hash"] != manifest)]
    capacity = {s: [r["capacity"] for r in ours if r["stage"] == s] for s in stages}
    limit = limiting_stage(capacity)
    notes = swarm_attention(ours, num_stages, behind_steps=2 * config.outer.inner_steps_per_outer)
    first = [r for r in ours if r["stage"] == 0 and r["status"] != "leaving"]
    finished = bool(first) and all(r["inner_step"] >= config.inner.total_steps for r in first)
    if finished:  # said first: an idle swarm is done, not broken (a newcomer read a finished run as stalled)
        notes.insert(
            0,
            f"the run is finished: stage 0's replicas trained all {config.inner.total_steps} inner steps "
            f"(inner.total_steps); its nodes serve the trained state (`noloco-node export` takes it)",
        )
    notes.extend(manifest_notes(rows, manifest))
    notes.extend(silent_notes(rows, config.timeouts.heartbeat_s, config.timeouts.record_ttl_s))
    m = config.model
    # A preset's shape (with the fields set over it); a model from a file is that file's, unread here.
    shape = m.shape() if not (m.config or m.init_from) else {}
    return {
        "schema": SCHEMA,
        "generated_at": time.time() if now is None else now,
        "run_id": config.run.run_id,
        "stages": num_stages,
        "run": {
            "run_id": config.run.run_id,
            "manifest_hash": manifest,
            "stages": num_stages,
            "method": config.outer.method,
            "inner_steps_per_outer": config.outer.inner_steps_per_outer,
            "model": {
                "hidden_size": shape.get("hidden_size"),
                "intermediate_size": shape.get("intermediate_size"),
                "num_layers": shape.get("num_layers"),
                "num_heads": shape.get("num_heads"),
                "seq_len": m.seq_len,
            },
        },
        "replicas": rows,
        "finished": finished,
        "stage_capacity": {str(s): sum(c) for s, c in capacity.items()},
        "limiting_stage": limit,
        "limiting_reason": limiting_reason(capacity, limit),
        "tokens_per_s": sum(r["tokens_per_s"] for r in ours if r["stage"] == 0 and r["status"] != "leaving"),
        "attention": notes,
    }


def swarm_manifest(rows: list[dict]) -> str:
    """The manifest most replicas announce ("" with none): what the swarm trains."""
    counts = Counter(r["manifest_hash"] for r in rows if r["manifest_hash"])
    return min(counts, key=lambda h: (-counts[h], h)) if counts else ""


def manifest_notes(rows: list[dict], manifest: str) -> list[str]:
    return [
        f"replica {r['peer_id'][-8:]} (stage {r['stage']}) announces manifest {r['manifest_hash'][:12]}, the swarm "
        f"trains {manifest[:12]}: it runs another config, tokenizer or model and never pairs or trains with the "
        f"others; restart it with the swarm's config (`noloco-node doctor` compares them)"
        for r in rows
        if manifest and r["manifest_hash"] and r["manifest_hash"] != manifest
    ]


def silent_notes(rows: list[dict], heartbeat_s: float, ttl_s: float) -> list[str]:
    """Replicas whose record was not rewritten for two heartbeats: stopped, stuck or cut off, and
    about to drop out of the swarm when the record expires."""
    return [
        f"replica {r['peer_id'][-8:]} (stage {r['stage']}) has not renewed its record for {r['seen_s_ago']:.0f} s "
        f"(every {heartbeat_s:.0f} s when well): it stopped, hangs or lost its link; peers stop routing to it when "
        f"the record expires ({ttl_s:.0f} s)"
        for r in rows
        if r["status"] != "leaving" and r["seen_s_ago"] > 2 * heartbeat_s
    ]


STALL_FLOOR_S = 30.0
"""A stage-0 replica that took no inner step for this long, and for STALL_TIMES its usual time
between steps, is named: the one-minute mean of tokens/s hides a stall that long (a soak's page
read 2,538 tok/s and every replica serving 30 s into a stop of the whole pipeline)."""
STALL_TIMES = 10


def stall_notes(rows: list[dict], history: SwarmHistory) -> list[str]:
    notes = []
    for row in rows:
        if row["stage"] != 0 or row["status"] in ("leaving", "joining"):
            continue
        paused = history.stalled_s(row["peer_id"])
        if paused is not None and paused[0] > max(STALL_FLOOR_S, STALL_TIMES * paused[1]):
            notes.append(
                f"replica {row['peer_id'][-8:]} (stage 0) has taken no inner step for {paused[0]:.0f} s (one every "
                f"{paused[1]:.1f} s before): its pipeline is stalled; its log and `noloco-node status` say why"
            )
    return notes


def limiting_reason(capacity: dict[int, list[float]], limit: int | None) -> str:
    totals = {s: sum(c) for s, c in capacity.items()}
    if limit is None:
        unmeasured = [s for s, t in totals.items() if t <= 0]
        return (
            (
                f"not known yet: stage{'s' if len(unmeasured) > 1 else ''} {', '.join(map(str, unmeasured))} "
                f"{'have' if len(unmeasured) > 1 else 'has'} no measured capacity (no replica, or none computed yet)"
            )
            if unmeasured
            else "not known yet"
        )
    others = sorted((t, s) for s, t in totals.items() if s != limit)
    count = len(capacity[limit])
    reason = (
        f"stage {limit}: {totals[limit]:.1f} sequences/s over {count} replica{'s' if count != 1 else ''}, "
        f"the least of the stages"
    )
    return reason + (f" (next: stage {others[0][1]}, {others[0][0]:.1f})" if others else "")


class SwarmView:
    """The swarm page's data: rows read from the DHT at most every `poll_s` (a page polling faster
    reuses them; the DHT is not read per request), and their history. `run()` also samples in the
    background, so the history of a bootstrap's page covers the time nobody watched."""

    def __init__(
        self,
        read: ReadRecords,
        config: NodeConfig,
        *,
        poll_s: float,
        limit: int = HISTORY_POINTS,
        clock: Callable[[], float] = time.monotonic,
        history_file: Path | None = None,
        save_every_s: float = 60.0,
    ) -> None:
        self.read, self.config, self.poll_s, self.clock = read, config, poll_s, clock
        self.history_file, self.save_every_s = history_file, save_every_s
        self.history = load_history(history_file, config.run.run_id, limit) if history_file else SwarmHistory(limit)
        self._saved_at = clock()
        self._latest: dict | None = None
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def swarm(self) -> dict:
        async with self._lock:  # concurrent requests share one read
            if self._latest is None or self.clock() - self._read_at >= self.poll_s:
                try:
                    await self._refresh()
                except Exception:
                    if self._latest is None:
                        raise
                    # The last good read stands (its generated_at shows its age); tried again next time.
                    log.warning("dashboard: reading the swarm's records failed; showing the last read", exc_info=True)
                    self._read_at = self.clock()
            return self._latest

    async def history_json(self) -> dict:
        if self._latest is None:
            await self.swarm()
        return self.history.as_json()

    async def run(self) -> None:
        """Sample every `poll_s` until cancelled; a failed read is tried again next period."""
        while True:
            try:
                await self.swarm()
            except Exception as exc:  # noqa: BLE001 - no read yet: tried again next period
                log.warning("dashboard: reading the swarm's records failed: %s", exc or type(exc).__name__)
            await asyncio.sleep(self.poll_s)

    async def save(self) -> None:
        """Write the history to `history_file` (off the loop: it can be megabytes); a failure is
        logged, never raised: the page goes on without it."""
        if self.history_file is None:
            return
        self._saved_at = self.clock()
        document = json.dumps({"run_id": self.config.run.run_id, **self.history.as_json()})
        try:
            await asyncio.to_thread(atomic_write_text, self.history_file, document)
        except OSError as exc:
            log.warning("dashboard: could not save its history to %s: %s", self.history_file, exc)

    async def _refresh(self) -> None:
        now = time.time()
        rows = await read_rows(self.read, self.config.pipeline.num_stages, now)
        latest = swarm_json(rows, self.config, now=now)
        self.history.observe(now, rows, latest["tokens_per_s"])
        if not latest["finished"]:
            latest["attention"][:0] = stall_notes(rows, self.history)
        self._latest, self._read_at = latest, self.clock()
        if self.history_file is not None and self.clock() - self._saved_at >= self.save_every_s:
            await self.save()


def load_history(path: Path, run_id: str, limit: int = HISTORY_POINTS) -> SwarmHistory:
    """The history a bootstrap's page saved before it stopped, so its charts survive a restart; a
    fresh one when there is none, or it is another run's, or unreadable (said, not raised). Such a
    file is moved aside first, not overwritten by the new history's first save."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("run_id") != run_id:
            other = re.sub(r"[^A-Za-z0-9_.-]", "_", str(data.get("run_id")))[:64]
            kept = _move_aside(path, path.with_name(f"{path.stem}.{other}{path.suffix}"))
            log.info("dashboard: %s held run %r's history (kept as %s); starting a new one", path, other, kept)
            return SwarmHistory(limit)
        history = SwarmHistory.from_json(data, limit)
    except FileNotFoundError:
        return SwarmHistory(limit)
    except (OSError, ValueError, TypeError) as exc:
        kept = _move_aside(path, path.with_name(path.name + ".unreadable"))
        log.warning("dashboard: its history %s is unreadable (%s; kept as %s); starting a new one", path, exc, kept)
        return SwarmHistory(limit)
    log.info("dashboard: history of %d replicas carried over from %s", len(history.inner_step), path)
    return history


def _move_aside(path: Path, to: Path) -> Path | str:
    try:
        return path.replace(to)
    except OSError:
        return "nowhere: it could not be moved"
