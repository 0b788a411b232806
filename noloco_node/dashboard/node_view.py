"""A node's own page (docs/dashboard.md, `/api/node`): what it contributes and how it is doing,
from its typed stats (runtime/node_stats.py) and the record it announces (a plain dict). `NodeView` samples
them for the charts; `LastProblem` remembers the last warning the node logged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

from noloco_node.dashboard.history import HISTORY_POINTS, NodeHistory
from noloco_node.runtime.node_stats import NodeStats

log = logging.getLogger(__name__)
SCHEMA = "noloco-node/node/1"


def training_flops_per_token(stage, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one stage: 6 per weight of its matrices (the embedding
    is a lookup, not a product) plus attention over on average T/2 earlier positions per layer,
    the per-token cost `noloco-node plan` counts (model/split.py)."""
    weights = sum(p.numel() for name, p in stage.named_parameters() if p.dim() >= 2 and "embed_tokens" not in name)
    layers = len(getattr(stage, "layer_range", ()))
    hidden = stage.config.hidden_size
    return 6.0 * (weights + layers * seq_len * hidden)


def partners(history: list[dict]) -> dict[str, int]:
    """Paired outer rounds per partner peer id."""
    return dict(Counter(h["partner"] for h in history if h.get("outcome") == "paired" and h.get("partner")))


def node_json(
    stats: NodeStats,
    record: Mapping,
    *,
    online_s: float,
    flops_per_token: float,
    method: str,
    last_error: dict | None,
    swarm_page: str = "/swarm",
    now: float | None = None,
) -> dict:
    """`/api/node` from `node_stats(node)` and the node's StageRecord fields."""
    work, outer = stats.work, stats.outer
    return {
        "schema": SCHEMA,
        "generated_at": time.time() if now is None else now,
        "peer_id": stats.peer_id,
        "stage": stats.stage,
        "address": stats.address,
        "status": record["status"],
        "version": record["version"],
        "run_id": record["run_id"],
        "manifest_hash": record["manifest_hash"],
        "method": method,
        "contribution": {
            "tokens": work.tokens,
            "flops": work.tokens * flops_per_token,
            "hours_online": online_s / 3600,
            "inner_steps": work.inner_steps,
            "microbatches_served": work.served,
            "microbatches_driven": stats.microbatches_completed,
            "outer_rounds": outer.counts.rounds if outer is not None else 0,
            "outer_paired": outer.counts.paired if outer is not None else 0,
            "partners": partners(outer.history if outer is not None else []),
            "bytes_sent": stats.bytes_sent,
            "bytes_received": work.bytes_received,
        },
        "health": {
            "reach": record["reach"],
            "link_mbit_s": record["link_mbit_s"],
            "memory_estimate_bytes": record["memory_estimate_bytes"],
            "memory_peak_bytes": record["memory_peak_bytes"],
            "in_flight": work.in_flight,
            "tokens_per_s": stats.tokens_per_s,
            "loss": stats.loss,
            "last_error": last_error,
            "attention": list(stats.attention),
        },
        "swarm_page": swarm_page,
    }


class LastProblem(logging.Handler):
    """The last WARNING or worse logged under `logger_name`, for the page's health box."""

    def __init__(self, logger_name: str = "noloco_node") -> None:
        super().__init__(logging.WARNING)
        self.logger_name = logger_name
        self.last: dict | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: show it raw rather than lose it
            message = str(record.msg)
        level = "error" if record.levelno >= logging.ERROR else "warning"
        self.last = {"at": record.created, "level": level, "message": message[:500]}

    def __enter__(self) -> LastProblem:
        logging.getLogger(self.logger_name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.logger_name).removeHandler(self)


class NodeView:
    """The node page's data: `node()` reads the node now (stats are in memory: no lookup), and
    `run()` samples its tokens/s and loss every `poll_s` for the charts."""

    def __init__(
        self,
        read: Callable[[], tuple[NodeStats, Mapping]],
        *,
        method: str,
        flops_per_token: float,
        poll_s: float,
        problems: LastProblem,
        limit: int = HISTORY_POINTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read, self.method, self.flops_per_token = read, method, flops_per_token
        self.poll_s, self.problems, self.clock = poll_s, problems, clock
        self.started = clock()
        self.history = NodeHistory(limit)

    async def node(self) -> dict:
        stats, record = self.read()
        return node_json(
            stats,
            record,
            online_s=self.clock() - self.started,
            flops_per_token=self.flops_per_token,
            method=self.method,
            last_error=self.problems.last,
        )

    async def history_json(self) -> dict:
        return self.history.as_json()

    def sample(self) -> None:
        stats, _ = self.read()
        self.history.observe(
            time.time(), tokens_per_s=stats.tokens_per_s, inner_step=stats.work.inner_steps, loss=stats.loss
        )

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - one sample lost; the page says the last error
                log.warning("dashboard: sampling the node failed", exc_info=True)
            await asyncio.sleep(self.poll_s)
