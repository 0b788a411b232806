"""Admission to a node's gRPC services: proven caller identities, the swarm key, the per-peer guard.

Every call but the standard health check must be signed by the caller's identity key
(transport/credentials.py: a token bound to this server, the method and a one-time nonce, plus
the swarm key's MAC in a keyed swarm). The identity a call runs under is the one its signature
proves; on the libp2p path the bridge also knows the peer id libp2p's handshake proved for the
connection, and the two must agree. A token that is missing, forged, stale or replayed is refused
with UNAUTHENTICATED before any servicer code runs. Plaintext connections are accepted only from
this node's own libp2p bridge (its loopback port), never from elsewhere.

In an open swarm Diagnostics may be called without a signature (doctor, load balancers): such a
caller is anonymous, limited per host. The standard health service stays open: it carries no data.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import secrets
from collections.abc import Callable
from pathlib import Path

import grpc

from noloco_node.rpc.guard import PeerGuard
from noloco_node.transport.credentials import CallAuthError, CallVerifier

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
ANONYMOUS_PREFIXES = ("/noloco.wire.v1.Diagnostics/",)
# The proven identity (and path) of the call being served, for servicers that check what a
# message claims about its sender (a route's last hop, a pairing request's peer id).
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("noloco_caller", default="")
CALLER_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("noloco_caller_path", default="")
# Set by a servicer that refused values which would corrupt the stage: the caller is banned at once.
POISONED: contextvars.ContextVar[bool] = contextvars.ContextVar("noloco_poisoned", default=False)


class SwarmKeyError(ValueError):
    pass


def generate_key() -> str:
    return secrets.token_hex(32)


def load_swarm_key(path: str | Path) -> bytes:
    """The key in a file written by `noloco-node keygen` (hex; at least 16 bytes)."""
    text = Path(path).read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SwarmKeyError(
            f"{path} does not hold a hex key; create one with `noloco-node keygen --out {path}`"
        ) from None
    if len(key) < 16:
        raise SwarmKeyError(f"{path} holds a {len(key)}-byte key; use at least 16 bytes (`noloco-node keygen`)")
    return key


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Proves the caller, then applies the peer's limits, before any servicer code runs; strikes
    the proven peer when the servicer rejected its data as INVALID_ARGUMENT."""

    def __init__(
        self,
        *,
        verifier: CallVerifier,
        swarm_key: bytes | None,
        guard: PeerGuard,
        bridged: Callable[[str], tuple[str, str] | None] | None = None,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.verifier, self.swarm_key, self.guard = verifier, swarm_key, guard
        self.bridged = bridged  # context.peer() of a plaintext connection -> (libp2p peer id, path)
        self.on_refused = on_refused  # (method, code name) for metrics
        self.refused: dict[str, int] = {}
        self.impostors = 0

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self.refused[code.name] = self.refused.get(code.name, 0) + 1
        if self.on_refused is not None:
            self.on_refused(method, code.name)

    def _prove(self, method: str, context) -> tuple[str, str]:
        """(proven peer id, path) of the caller; raises CallAuthError."""
        secure = context.auth_context().get("transport_security_type") == [b"ssl"]
        # A TLS connection the bridge made is a relay splice: the origin names the relay, not the
        # caller (end-to-end TLS and the call's signature prove the caller), and gives the path.
        origin = None if self.bridged is None else self.bridged(context.peer())
        if not secure and origin is None:
            raise CallAuthError("plaintext connections are accepted only from this node's libp2p bridge; use TLS")
        path = origin[1] if origin is not None else "direct"
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        if self.swarm_key is None and method.startswith(ANONYMOUS_PREFIXES) and "x-noloco-auth" not in metadata:
            return "anon@" + _host_of(context.peer()), path
        peer = self.verifier.verify(metadata, method)
        if not secure and origin[0] != peer:
            self.impostors += 1
            raise CallAuthError(f"the token names peer {peer[:16]}... but libp2p proved {origin[0][:16]}...")
        return peer, path

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        return self._wrap(handler, details.method)

    async def _gate(self, method: str, context) -> str:
        """The caller's proven identity if the call may run (else the call is aborted)."""
        try:
            peer, path = self._prove(method, context)
        except CallAuthError as exc:
            self._count(method, grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        why = self.guard.admit(peer)
        if why is not None:
            self._count(method, grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        CALLER.set(peer)
        CALLER_PATH.set(path)
        POISONED.set(False)
        return peer

    def _finished(self, method: str, peer: str, context) -> None:
        """Tells the guard how the call ended: an INVALID_ARGUMENT is a strike, poisoned values a ban."""
        code = context.code()
        invalid = "invalid_argument" if code == grpc.StatusCode.INVALID_ARGUMENT else None
        poisoned = invalid is not None and POISONED.get()
        banned_s = self.guard.finish(peer, "poisoned" if poisoned else invalid, at_once=poisoned)
        if banned_s is not None:
            log.warning(
                "banned peer %s for %.0f s after %s (last on %s)",
                peer,
                banned_s,
                "values that would corrupt this stage" if poisoned else "repeated invalid messages",
                method,
            )

    def _wrap(self, handler, method: str):
        def wrap_call(behavior):
            if behavior is None:
                return None
            if inspect.isasyncgenfunction(behavior):

                async def streamed(request, context):
                    peer = await self._gate(method, context)
                    try:
                        async for item in behavior(request, context):
                            yield item
                    finally:
                        self._finished(method, peer, context)

                return streamed

            async def called(request, context):
                peer = await self._gate(method, context)
                try:
                    return await behavior(request, context)
                finally:
                    self._finished(method, peer, context)

            return called

        return handler._replace(
            unary_unary=wrap_call(handler.unary_unary),
            unary_stream=wrap_call(handler.unary_stream),
            stream_unary=wrap_call(handler.stream_unary),
            stream_stream=wrap_call(handler.stream_stream),
        )


def _host_of(peer: str) -> str:
    """ "ipv4:1.2.3.4:5678" -> "1.2.3.4": anonymous callers are limited per host."""
    kind, _, rest = peer.partition(":")
    host, _, _ = rest.rpartition(":")
    return host or peer
