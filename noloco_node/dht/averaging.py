"""All-reduce for the DiLoCo baseline: hivemind's DecentralizedAverager over a hivemind DHT peer.

hivemind runs both as forked processes; create this before the node starts gRPC (forking a
process with live gRPC threads is unsafe). Knows hivemind and torch tensors, not models.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class HivemindAllReduce:
    """Averages a fixed list of tensors with every replica of a stage that joins the same round."""

    def __init__(self, shapes: list[torch.Size], *, initial_peers: list[str], host: str, prefix: str,
                 target_group_size: int, matchmaking_s: float, dht=None, port: int = 0,
                 announce: str | None = None, swarm_key: bytes | None = None, max_skew_s: float = 60.0) -> None:
        from hivemind.averaging import DecentralizedAverager

        self.dht = dht if dht is not None else self.start_dht(initial_peers, host, port, announce, swarm_key, max_skew_s)
        self.averager = DecentralizedAverager(
            [torch.zeros(s) for s in shapes], dht=self.dht, prefix=prefix, target_group_size=target_group_size,
            # hivemind: request_timeout must stay below min_matchmaking_time, or matchmaking can deadlock.
            min_group_size=2, min_matchmaking_time=max(1.0, matchmaking_s), request_timeout=max(1.0, matchmaking_s) / 2,
            start=True)
        self.bytes_sent = 0

    @staticmethod
    def start_dht(initial_peers: list[str], host: str, port: int = 0, announce: str | None = None,
                  swarm_key: bytes | None = None, max_skew_s: float = 60.0):
        """hivemind's DHT process. Blocks until it has pinged an initial peer: when that peer is
        served by this process's own event loop, call this from a worker thread. `announce`
        (host:port) is the address other peers should dial, e.g. a WAN relay in front of `port`."""
        import hivemind

        extra = {}
        if announce:
            a_host, _, a_port = announce.rpartition(":")
            extra["announce_maddrs"] = [f"/ip4/{a_host}/tcp/{a_port}"]
        if swarm_key is not None:
            from noloco_node.dht.auth import SwarmKeyAuthorizer

            extra["authorizer"] = SwarmKeyAuthorizer(swarm_key, max_skew_s=max_skew_s)
        return hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=[f"/ip4/{host}/tcp/{port}"], start=True, **extra)

    async def mean(self, tensors: list[Tensor], timeout_s: float, round_index: int = 0) -> tuple[list[Tensor], int, bool]:
        """Mean of `tensors` over the group that forms; returns (means, group size, whether every
        member was at `round_index`). A group of one (nobody else joined in time) returns the
        inputs unchanged with size 1. hivemind's matchmaking does not separate rounds, so a
        lagging replica can land in a group of the next round: that is reported, not hidden."""
        with self.averager.get_tensors() as shared:
            for dst, src in zip(shared, tensors):
                dst.copy_(src)
        loop = asyncio.get_running_loop()
        control = self.averager.step(gather=round_index, timeout=timeout_s, allow_retries=True, wait=False)
        try:
            # hivemind's own timeout covers matchmaking only; an all-reduce whose group stalls could
            # block forever, so the round has a hard deadline of its own.
            group = await asyncio.wait_for(loop.run_in_executor(None, control.result),
                                           timeout=2 * timeout_s + 10)
        except Exception as exc:  # noqa: BLE001 - hivemind raises several types; the caller falls back
            control.cancel()
            log.warning("all-reduce failed: %s", exc or type(exc).__name__)
            group = None
        if not group:
            return [t.clone() for t in tensors], 1, True
        with self.averager.get_tensors() as shared:
            means = [t.clone() for t in shared]
        self.bytes_sent += 2 * sum(t.numel() * 4 for t in tensors) * (len(group) - 1) // len(group)
        return means, len(group), all(value == round_index for value in group.values())

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()
