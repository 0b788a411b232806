"""The libp2p daemon and the hivemind DHT node a PeerDirectory runs on (dht/directory.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from contextvars import ContextVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, P2PDaemonError

from noloco_node.dht.stale_sockets import remove_stale_sockets
from noloco_node.errors import BootstrapError
from noloco_node.transport.addresses import maddr_is_loopback

log = logging.getLogger(__name__)


async def join_dht(args: dict, validator: CompositeValidator, p2p_options: dict | None) -> tuple[DHTNode, P2P]:
    """PeerDirectory.start()'s libp2p daemon and DHT node, from its `args`; BootstrapError with a
    fix if no initial peer answers."""
    initial_peers, swarm_key, timeout_s = args["initial_peers"], args["swarm_key"], args["startup_timeout_s"]
    authorizer = None
    if swarm_key is not None:
        from noloco_node.dht.auth import SwarmKeyAuthorizer

        authorizer = SwarmKeyAuthorizer(swarm_key, max_skew_s=args["max_skew_s"])
    options = dict(p2p_options or {})
    await asyncio.to_thread(remove_stale_sockets)  # sockets killed processes left (dht/stale_sockets.py)
    daemon_flags = options.pop("daemon_flags", {})
    p2p = None
    try:
        # Our own P2P (DHTNode would make one without the flags hivemind does not expose).
        p2p = await daemon_with_flags(daemon_flags).create(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/ip4/{args['host']}/tcp/{args['port']}"],
            identity_path=args["key"].identity_path(),
            check_if_identity_free=False,
            startup_timeout=timeout_s,
            dht_mode="client" if args["client_mode"] else "server",
            **options,
        )
        args["key"].close()  # the daemon has read its key: no copy of it waits in /tmp for a kill -9
        node = await asyncio.wait_for(
            DHTNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers),
                record_validator=validator,
                client_mode=args["client_mode"],
                authorizer=authorizer,
            ),
            timeout=timeout_s + 5,
        )
    except (P2PDaemonError, asyncio.TimeoutError, OSError, RuntimeError) as exc:
        # hivemind raises RuntimeError when no initial peer answered a ping: they are down,
        # unreachable, or (in a keyed swarm) ignoring us because our swarm key differs.
        where = ", ".join(initial_peers) or "(none)"
        args["key"].close()
        if p2p is not None:
            await p2p.shutdown()
        hint = BootstrapError.hint + ("" if swarm_key is None else "; and that your swarm key is the swarm's")
        if swarm_key is None and initial_peers:
            hint += "; a swarm with a key answers only joiners that pass it with --swarm-key"
        if initial_peers and all(maddr_is_loopback(m) for m in initial_peers):
            # The bootstrap prints a loopback line too: copied to another machine, it dials that machine.
            hint = (
                "127.0.0.1 is this machine: run the bootstrap here, or, joining from another machine, use the "
                "join line the bootstrap printed with its network address (not 127.0.0.1); " + hint
            )
        raise BootstrapError(
            f"could not join the DHT through initial peers {where}: {bootstrap_failure(exc, timeout_s)}", hint=hint
        ) from None
    return node, p2p


def bootstrap_failure(exc: BaseException, timeout_s: float) -> str:
    """What went wrong, in the user's words: hivemind's and the Go daemon's texts name settings the
    user cannot set and call a failed dial a daemon that failed to start (a newcomer's audit)."""
    text = str(exc)
    if "failed to connect to bootstrap peers" in text:
        return "none of them could be connected to (a wrong host, port or peer id, or the peer is down)"
    if "responded to a ping" in text:
        return "connected, but none of them answered (the peer is not a DHT peer of this swarm, or ignores us)"
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within timeouts.startup_s ({timeout_s:g} s)"
    return text or type(exc).__name__


def daemon_with_flags(flags: dict):
    """hivemind.P2P whose p2pd gets extra command-line flags, e.g. relayDiscovery=False, which
    makes the trusted relays static: the reservation is made at once (~0.2 s) instead of after
    auto-relay's three-minute wait for more relay candidates; and which cleans up after a daemon
    that failed to start (ReapedP2P)."""
    if not flags:
        return ReapedP2P

    class P2PWithFlags(ReapedP2P):
        @staticmethod
        def _make_process_args(*args, **kwargs):
            return P2P._make_process_args(*args, **{**kwargs, **flags})

    return P2PWithFlags


# The P2P objects P2P.create() makes in the current task: it makes one and loses it when it raises.
_CREATING: ContextVar[list | None] = ContextVar("noloco_p2p_creating", default=None)


class ReapedP2P(P2P):
    """P2P that, when create() fails after it started the daemon (no initial peer answered, most
    often: a wrong address), waits for that daemon and removes its socket files. hivemind leaves
    both: the daemon's socket stays in /tmp once the daemon exited by itself, and a child nobody
    waited for makes asyncio warn "Loop ... that handles pid ... is closed" at exit."""

    def __init__(self) -> None:
        super().__init__()
        creating = _CREATING.get()
        if creating is not None:
            creating.append(self)

    @classmethod
    async def create(cls, *args, **kwargs) -> P2P:
        creating: list = []
        token = _CREATING.set(creating)
        try:
            return await super().create(*args, **kwargs)
        except BaseException:
            for p2p in creating:
                await _reap(p2p)
            raise
        finally:
            _CREATING.reset(token)


async def _reap(p2p: P2P) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), timeout=5)  # terminates a daemon still up, waits for it
    for maddr in (getattr(p2p, "_daemon_listen_maddr", None), getattr(p2p, "_client_listen_maddr", None)):
        with contextlib.suppress(Exception):
            os.remove(maddr["unix"])


async def ping_peers(
    p2p: P2P, node: DHTNode, targets: dict[str, list[str]], timeout_s: float, connected: set[str]
) -> int:
    """DHT-ping each of `targets` (peer id -> transport addresses), dialling only those `connected`
    lacks; how many answered. A ping puts each side in the other's routing table."""
    from hivemind.p2p import PeerID

    from noloco_node.transport.bridge import DaemonMaddr

    async def one(peer_id: str, addrs: list[str]) -> bool:
        peer = PeerID.from_base58(peer_id)
        try:
            if peer_id not in connected:
                await asyncio.wait_for(p2p._client.connect(peer, [DaemonMaddr(a) for a in addrs]), timeout_s)
            return (
                await asyncio.wait_for(node.protocol.call_ping(peer, validate=False, strict=False), timeout_s)
                is not None
            )
        except Exception as exc:  # noqa: BLE001 - tried again on the next heartbeat
            log.debug("peer %s did not answer: %r", peer_id[-8:], exc)
            return False

    return sum(await asyncio.gather(*(one(p, a) for p, a in targets.items())))


def peers_by_id(maddrs: list[str], own_peer_id: str) -> dict[str, list[str]]:
    """Peer id -> its transport addresses, from full multiaddrs (`.../p2p/<peer id>`)."""
    out: dict[str, list[str]] = {}
    for maddr in maddrs:
        base, _, peer_id = maddr.rpartition("/p2p/")
        if base and peer_id and peer_id != own_peer_id:
            out.setdefault(peer_id, []).append(base)
    return out
