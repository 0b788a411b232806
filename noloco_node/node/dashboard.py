"""A node's dashboard (docs/dashboard.md): its own page at `/`, and the swarm as it sees it at
`/swarm`, on `network.dashboard`. The node page is sampled in the background from memory; the
swarm page reads the DHT only while someone watches it (at most every `dashboard_poll_s`), so an
unwatched dashboard costs the training node no lookups."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from noloco_node.config.listen import parse_listen
from noloco_node.dashboard.http import DashboardServer, page_url
from noloco_node.dashboard.node_view import LastProblem, NodeView, training_flops_per_token
from noloco_node.dashboard.swarm import SwarmView

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node

log = logging.getLogger(__name__)


class NodeDashboard:
    def __init__(self, server: DashboardServer, port: int, problems: LastProblem, sampling: asyncio.Task) -> None:
        self.server, self.port, self.problems, self.sampling = server, port, problems, sampling

    @classmethod
    async def open(cls, node: Node) -> NodeDashboard:
        cfg = node.config
        host, port = parse_listen(cfg.network.dashboard)
        problems = LastProblem().__enter__()
        view = NodeView(
            lambda: (node.read_stats(), node.record().dict(exclude={"tls_cert"})),
            method=cfg.outer.method,
            flops_per_token=training_flops_per_token(node.parts.stage, cfg.model.seq_len),
            poll_s=cfg.network.dashboard_poll_s,
            problems=problems,
        )
        swarm = SwarmView(node.directory.all_records, cfg, poll_s=cfg.network.dashboard_poll_s)
        server = DashboardServer(
            pages={"/": "node.html", "/swarm": "swarm.html"},
            api={
                "/api/node": view.node,
                "/api/node/history": view.history_json,
                "/api/swarm": swarm.swarm,
                "/api/history": swarm.history_json,
            },
        )
        try:
            bound = await server.start(host, port)
        except BaseException:
            problems.__exit__(None, None, None)
            raise
        log.info("dashboard at %s", page_url(host, bound))
        return cls(server, bound, problems, asyncio.create_task(view.run()))

    async def close(self) -> None:
        self.sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sampling
        await self.server.stop()
        self.problems.__exit__(None, None, None)
