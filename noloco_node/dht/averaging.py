"""All-reduce for the DiLoCo and data-parallel baselines: hivemind's DecentralizedAverager over a
hivemind DHT peer.

hivemind hands each member the mean as `local + (mean - local)`, rounded in the tensors' dtype,
so in fp32 the members' results differ where the replicas' values nearly cancel (the error is
an ulp of the local value, not of the mean). For data-parallel gradients Adam turns those
differences into different updates and the "identical" replicas drift (seen: sigma 2.5e-4 after
80 steps). `dtype=torch.float64` averages in float64 (twice the bytes) and rounds the result to
float32 on every member alike.

hivemind runs both as forked processes; create this before the node starts gRPC (forking a
process with live gRPC threads is unsafe). Knows hivemind and torch tensors, not models.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CHECK_EVERY = 4096  # elements between check values; hivemind's parts are far larger (512 KiB)


class HivemindAllReduce:
    """Averages a fixed list of tensors with every replica of a stage that joins the same round."""

    def __init__(self, shapes: list[torch.Size], *, initial_peers: list[str], host: str, prefix: str,
                 target_group_size: int, matchmaking_s: float, dht=None, port: int = 0,
                 announce: str | None = None, swarm_key: bytes | None = None, max_skew_s: float = 60.0,
                 dtype: torch.dtype = torch.float32) -> None:
        from hivemind.averaging import DecentralizedAverager

        self.dht = dht if dht is not None else self.start_dht(initial_peers, host, port, announce, swarm_key, max_skew_s)
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(math.prod(s) for s in self.shapes)
        self.rows = max(1, math.ceil(self.numel / CHECK_EVERY))
        self.rng = random.Random()
        self.averager = DecentralizedAverager(
            [torch.zeros(self.rows * (CHECK_EVERY + 1), dtype=dtype)], dht=self.dht, prefix=prefix, target_group_size=target_group_size,
            # hivemind: request_timeout must stay below min_matchmaking_time, or matchmaking can deadlock.
            min_group_size=2, min_matchmaking_time=max(1.0, matchmaking_s), request_timeout=max(1.0, matchmaking_s) / 2,
            start=True)
        self.bytes_sent = 0
        self.element_size = torch.finfo(dtype).bits // 8
        self.partial_rounds = 0

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

    async def mean(self, tensors: list[Tensor], timeout_s: float,
                   round_index: int = 0) -> tuple[list[Tensor], int, bool, bool]:
        """Mean of `tensors` over the group that forms; returns (means, group size, whether every
        member was at `round_index`, whether the result is complete). A group of one (nobody else
        joined in time) returns the inputs unchanged with size 1. hivemind's matchmaking does not
        separate rounds, so a lagging replica can land in a group of the next round, and its
        all-reduce can deliver part of the mean only: both are reported, not hidden."""
        check = float(self.rng.randrange(1024, 2048))
        with self.averager.get_tensors() as shared:
            payload = torch.zeros(self.rows * CHECK_EVERY, dtype=shared[0].dtype)
            payload[:self.numel] = torch.cat([t.detach().reshape(-1).to("cpu", payload.dtype) for t in tensors])
            grid = shared[0].view(self.rows, CHECK_EVERY + 1)
            grid[:, :CHECK_EVERY] = payload.view(self.rows, CHECK_EVERY)
            grid[:, CHECK_EVERY] = check
        loop = asyncio.get_running_loop()
        control = self.averager.step(gather={"round": round_index, "check": check}, timeout=timeout_s,
                                     allow_retries=True, wait=False)
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
            return [t.clone() for t in tensors], 1, True, True
        with self.averager.get_tensors() as shared:
            grid = shared[0].view(self.rows, CHECK_EVERY + 1).clone()
        expected = sum(float(v["check"]) for v in group.values()) / len(group)
        complete = bool(((grid[:, CHECK_EVERY].double() - expected).abs() <= 1e-6 * expected).all())
        if not complete:
            self.partial_rounds += 1
            log.warning("the all-reduce delivered part of the mean only (hivemind kept our own values for the rest)")
        flat = grid[:, :CHECK_EVERY].reshape(-1)[:self.numel]
        means, offset = [], 0
        for src in tensors:
            means.append(flat[offset:offset + src.numel()].view(src.shape).to(src.dtype))
            offset += src.numel()
        self.bytes_sent += 2 * grid.numel() * self.element_size * (len(group) - 1) // len(group)
        return means, len(group), all(v["round"] == round_index for v in group.values()), complete

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()
