"""All-reduce for the DiLoCo and data-parallel baselines: hivemind's DecentralizedAverager over a
hivemind DHT peer.

hivemind runs both as forked processes; create this before the node starts gRPC (forking a
process with live gRPC threads is unsafe). Knows hivemind and torch tensors, not models.

Three properties of hivemind's all-reduce this module handles:
- Each member gets the mean as `local + (mean - local)`, rounded in the tensors' dtype, so in
  fp32 the members' results differ where the replicas' values nearly cancel (by an ulp of the
  local value, not of the mean). For data-parallel gradients Adam turns that into different
  updates and "identical" replicas drift (seen: sigma 2.5e-4 after 80 steps). With
  `dtype=torch.float64` the mean is computed and applied in float64 and every member rounds the
  same value to float32.
- A member whose reducer's result stream ends early keeps its own values for the parts it did
  not receive, and hivemind only logs it ("Averaging: received 74.7% results"; seen on loopback
  about once in a few dozen rounds, "peer X sent 8 parts, but we expected 16"). Those warnings
  are counted through a counter shared with the forked averager, and `mean` reports such a round
  as incomplete instead of passing a partial mean off as the group mean.
- Matchmaking knows no rounds: any averagers looking at once under one key form a group, so a
  lagging replica landed in the next round's group (seen: 26 mixed-round groups of 96 in a 4 x 2
  DiLoCo demo), and with min_group_size 2 a group formed with whoever came within
  min_matchmaking_time. Each round therefore gets its own group key (`round_key_bits`), which
  hivemind checks on every join request, and with a known membership D the group must be all D
  (`min_group_size`): a round either averages over every replica of that round or fails for all
  its members within the deadline, which the caller counts as a solo step.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# hivemind's loggers whose "received N% ..." warnings mean that a member used its own values.
_PARTIAL_LOGGERS = ("hivemind.averaging.partition",)
_ROUND_BITS = 32


def round_key_bits(round_index: int) -> str:
    """The group-key bits of a round (hivemind's key is `prefix.0b<bits>`): averagers of different
    rounds never share a key, so they can never share a group."""
    return format(round_index % (1 << _ROUND_BITS), f"0{_ROUND_BITS}b")


def _plain_signals_in_child() -> None:
    """Runs in every process forked from a node (hivemind's DHT and averager). The node's asyncio
    loop routes SIGTERM and SIGINT to a handler that only writes to the loop's wakeup pipe; a fork
    inherits both, so the child ignored SIGTERM (hivemind's `terminate()` after a stuck shutdown
    did nothing, and interpreter exit then waited on it: seen, 25-90 s per DiLoCo or dp node) and
    woke the parent's loop as if the parent had been signalled. SIGTERM stops a child; SIGINT (a
    Ctrl-C reaches the whole process group) is left to the parent, which shuts its children down."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread of the main interpreter: nothing was inherited there
        pass


os.register_at_fork(after_in_child=_plain_signals_in_child)


class _PartialResultCounter(logging.Handler):
    """Runs inside the forked averager process; counts hivemind's partial-result warnings."""

    def __init__(self, counter) -> None:
        super().__init__(logging.WARNING)
        self.counter = counter

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "received" in message and ("results" in message or "input tensors" in message):
            with self.counter.get_lock():
                self.counter.value += 1


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """How an all-reduce group forms and how long a round may take."""

    prefix: str
    """The group key's prefix: one per run, stage and method."""
    target_group_size: int
    min_group_size: int = 2
    matchmaking_s: float = 1.0
    allreduce_s: float = 60.0
    dtype: torch.dtype = torch.float32
    """float64 makes every member round the same mean (module docstring)."""


@dataclass(frozen=True, kw_only=True)
class DhtPeer:
    """Where the all-reduce's own hivemind DHT peer listens and whom it bootstraps from."""

    initial_peers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    announce: str | None = None
    swarm_key: bytes | None = None
    max_skew_s: float = 60.0


class HivemindAllReduce:
    """Averages a fixed list of tensors with every replica of a stage that joins the same round."""

    def __init__(
        self, shapes: list[torch.Size], group: GroupSettings, *, peer: DhtPeer | None = None, dht=None
    ) -> None:
        """Give `peer` to start a DHT peer of its own, or a running hivemind `dht`."""
        from hivemind.averaging import DecentralizedAverager

        dtype, matchmaking_s, target_group_size = group.dtype, group.matchmaking_s, group.target_group_size
        min_group_size, allreduce_s, prefix = group.min_group_size, group.allreduce_s, group.prefix
        self.dht = (
            dht
            if dht is not None
            else self.start_dht(
                list(peer.initial_peers), peer.host, peer.port, peer.announce, peer.swarm_key, peer.max_skew_s
            )
        )
        # Shared with the averager process, which is forked below and inherits the handler.
        self.partial_warnings = multiprocessing.get_context("fork").Value("i", 0)
        self._handler = _PartialResultCounter(self.partial_warnings)
        for name in _PARTIAL_LOGGERS:
            logging.getLogger(name).addHandler(self._handler)
        self.averager = DecentralizedAverager(
            [torch.zeros(s, dtype=dtype) for s in shapes],
            dht=self.dht,
            prefix=prefix,
            target_group_size=target_group_size,
            # hivemind: request_timeout must stay below min_matchmaking_time, or matchmaking can deadlock.
            min_group_size=max(2, min(min_group_size, target_group_size)),
            min_matchmaking_time=max(1.0, matchmaking_s),
            request_timeout=max(1.0, matchmaking_s) / 2,
            # Without these an all-reduce whose peer stream stalls waits forever (seen: two of three
            # replicas stuck until our own deadline, then no further rounds).
            next_chunk_timeout=max(5.0, 2 * matchmaking_s),
            allreduce_timeout=allreduce_s,
            initial_group_bits=round_key_bits(0),
            start=True,
        )
        self.allreduce_s = allreduce_s
        self.bytes_sent = 0
        self.element_size = torch.finfo(dtype).bits // 8
        self.partial_rounds = 0

    @staticmethod
    def start_dht(
        initial_peers: list[str],
        host: str,
        port: int = 0,
        announce: str | None = None,
        swarm_key: bytes | None = None,
        max_skew_s: float = 60.0,
    ):
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
        return hivemind.DHT(
            initial_peers=list(initial_peers), host_maddrs=[f"/ip4/{host}/tcp/{port}"], start=True, **extra
        )

    async def mean(
        self, tensors: list[Tensor], timeout_s: float, round_index: int = 0
    ) -> tuple[list[Tensor], int, bool, bool]:
        """Mean of `tensors` over the group that forms; returns (means, group size, whether every
        member was at `round_index`, whether the whole mean arrived). A group of one (nobody else
        joined in time) returns the inputs unchanged with size 1. Only averagers at `round_index`
        can join (the round's own group key), but a round can deliver part of the mean only, and
        that is reported, not hidden."""
        with self.averager.get_tensors() as shared:
            for dst, src in zip(shared, tensors):
                dst.copy_(src)
        warnings_before = self.partial_warnings.value
        loop = asyncio.get_running_loop()
        # Both calls wait on the averager process, which a loaded machine can keep busy for a
        # while: off the event loop, so this node's gRPC keeps serving meanwhile.
        await loop.run_in_executor(None, partial(self.averager.set_group_bits, round_key_bits(round_index)))
        control = await loop.run_in_executor(
            None, partial(self.averager.step, gather=round_index, timeout=timeout_s, allow_retries=True, wait=False)
        )
        try:
            # hivemind's own timeout covers matchmaking only; an all-reduce whose group stalls could
            # block forever, so the round has a hard deadline of its own.
            group = await asyncio.wait_for(
                loop.run_in_executor(None, control.result), timeout=timeout_s + self.allreduce_s + 10
            )
        except Exception as exc:  # noqa: BLE001 - hivemind raises several types; the caller falls back
            control.cancel()
            log.warning("all-reduce failed: %s", exc or type(exc).__name__)
            group = None
        if not group:
            return [t.clone() for t in tensors], 1, True, True
        with self.averager.get_tensors() as shared:
            means = [t.to(dtype=src.dtype, copy=True) for t, src in zip(shared, tensors)]
        complete = self.partial_warnings.value == warnings_before
        if not complete:
            self.partial_rounds += 1
            log.warning(
                "round %d: the all-reduce delivered part of the mean only (hivemind kept local values for the rest)",
                round_index,
            )
        self.bytes_sent += 2 * sum(t.numel() * self.element_size for t in tensors) * (len(group) - 1) // len(group)
        return means, len(group), all(value == round_index for value in group.values()), complete

    def shutdown(self) -> None:
        for name in _PARTIAL_LOGGERS:
            logging.getLogger(name).removeHandler(self._handler)
        self.averager.shutdown()
        self.dht.shutdown()


def build_all_reduce(cfg, stage: int, shapes: list[torch.Size], swarm_key: bytes | None) -> HivemindAllReduce:
    """The diloco/dp all-reduce of this node's stage from its NodeConfig. hivemind forks its DHT and
    averager processes: call this before gRPC starts any thread.

    With a known membership (outer.allreduce_group_size = D) every round's group is all D replicas
    or the round fails; unknown (0), any 2 or more that meet within timeouts.match_s average."""
    from noloco_node.dht.records import key_prefix

    outer, net, dp = cfg.outer, cfg.network, cfg.outer.method == "dp"
    known = outer.allreduce_group_size
    group = GroupSettings(
        prefix=f"{key_prefix(cfg.run.run_id)}_stage{stage}_{outer.method}",
        target_group_size=known or 64,
        min_group_size=known or 2,
        matchmaking_s=cfg.timeouts.match_s,
        allreduce_s=cfg.timeouts.allreduce_s,
        # dp: gradients averaged in float64 so every replica rounds the same mean (module docstring)
        dtype=torch.float64 if dp else torch.float32,
    )
    peer = DhtPeer(
        initial_peers=tuple(net.initial_peers),
        host=net.host,
        port=net.allreduce_port,
        announce=net.allreduce_announce,
        swarm_key=swarm_key,
        max_skew_s=cfg.security.max_clock_skew_s,
    )
    return HivemindAllReduce(shapes, group, peer=peer)
