"""Admission to a node's gRPC services: an optional swarm key and the per-peer guard.

With a swarm key every call carries `x-noloco-auth: <peer id>.<unix ms>.<hmac>`, the HMAC-SHA256
of "<peer id>\\n<method>\\n<unix ms>" under the key. The server interceptor refuses a call with
UNAUTHENTICATED when the token is missing, malformed, signed with another key, made for another
method, or stamped further than `max_skew_s` from our clock. Without a key (an open swarm) callers
only name themselves in `x-noloco-peer`, which anyone can forge: the guard's per-peer limits
then bind claimed identities, and the global cap on concurrent calls binds everyone.

The standard health service stays open: it carries no data, and load balancers and doctor's
reachability check call it without credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from noloco_node.rpc.guard import PeerGuard

log = logging.getLogger(__name__)

AUTH_HEADER = "x-noloco-auth"
PEER_HEADER = "x-noloco-peer"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


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
        raise SwarmKeyError(f"{path} does not hold a hex key; create one with `noloco-node keygen --out {path}`") from None
    if len(key) < 16:
        raise SwarmKeyError(f"{path} holds a {len(key)}-byte key; use at least 16 bytes (`noloco-node keygen`)")
    return key


def _mac(key: bytes, peer_id: str, method: str, stamp_ms: int) -> str:
    return hmac.new(key, f"{peer_id}\n{method}\n{stamp_ms}".encode(), hashlib.sha256).hexdigest()


def make_token(key: bytes, peer_id: str, method: str, now: float | None = None) -> str:
    stamp_ms = int((time.time() if now is None else now) * 1000)
    return f"{peer_id}.{stamp_ms}.{_mac(key, peer_id, method, stamp_ms)}"


def verify_token(key: bytes, token: str | None, method: str, max_skew_s: float, now: float | None = None) -> str:
    """The caller's peer id if `token` is valid for `method`; raises SwarmKeyError saying why not."""
    if not token:
        raise SwarmKeyError("no swarm-key token: this swarm requires one (security.swarm_key_file)")
    parts = token.split(".")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0]:
        raise SwarmKeyError("malformed swarm-key token")
    peer_id, stamp, mac = parts
    skew = abs((time.time() if now is None else now) - int(stamp) / 1000)
    if skew > max_skew_s:
        raise SwarmKeyError(f"token time is {skew:.0f} s from ours (limit {max_skew_s:g} s): check the clock (NTP)")
    if not hmac.compare_digest(mac, _mac(key, peer_id, method, int(stamp))):
        raise SwarmKeyError("token was not made with this swarm's key")
    return peer_id


class ClientIdentity:
    """Who we are on outgoing calls; `peer_id` may be set once the DHT has given us one."""

    def __init__(self, key: bytes | None = None, peer_id: str = "") -> None:
        self.key, self.peer_id = key, peer_id

    def metadata(self, method: str) -> list[tuple[str, str]]:
        peer_id = self.peer_id or "anonymous"
        if self.key is None:
            return [(PEER_HEADER, peer_id)]
        return [(AUTH_HEADER, make_token(self.key, peer_id, method))]


def _with_identity(identity: ClientIdentity, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    metadata = list(details.metadata or ()) + identity.metadata(method)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, identity: ClientIdentity) -> None:
        self.identity = identity

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_identity(self.identity, details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, identity: ClientIdentity) -> None:
        self.identity = identity

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_identity(self.identity, details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, identity: ClientIdentity) -> None:
        self.identity = identity

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_identity(self.identity, details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, identity: ClientIdentity) -> None:
        self.identity = identity

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_identity(self.identity, details), request_iterator)


def open_channel(address: str, identity: ClientIdentity | None, options: list | None = None) -> grpc.aio.Channel:
    """An insecure channel whose every call names us (and signs, with a swarm key)."""
    interceptors = None
    if identity is not None:
        interceptors = [cls(identity) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Checks the swarm key, then the peer's limits, before any servicer code runs; strikes the
    peer when the servicer rejected its data as INVALID_ARGUMENT."""

    def __init__(self, *, key: bytes | None, max_skew_s: float, guard: PeerGuard,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.key, self.max_skew_s, self.guard = key, max_skew_s, guard
        self.on_refused = on_refused  # (method, code name) for metrics
        self.refused: dict[str, int] = {}

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self.refused[code.name] = self.refused.get(code.name, 0) + 1
        if self.on_refused is not None:
            self.on_refused(method, code.name)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        refusal, peer = None, None
        if self.key is not None:
            try:
                peer = verify_token(self.key, metadata.get(AUTH_HEADER), details.method, self.max_skew_s)
            except SwarmKeyError as exc:
                refusal = (grpc.StatusCode.UNAUTHENTICATED, str(exc))
        else:
            peer = metadata.get(PEER_HEADER)
        return self._wrap(handler, details.method, refusal, peer)

    def _wrap(self, handler, method: str, refusal, claimed_peer: str | None):
        async def gate(context) -> str | None:
            """The peer's identity if the call may run, else None after aborting it."""
            if refusal is not None:
                self._count(method, refusal[0])
                await context.abort(*refusal)
            peer = claimed_peer[:128] if claimed_peer else _host_of(context.peer())
            why = self.guard.admit(peer)
            if why is not None:
                self._count(method, grpc.StatusCode.RESOURCE_EXHAUSTED)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            return peer

        def finished(peer: str, context) -> None:
            code = context.code()
            invalid = "invalid_argument" if code == grpc.StatusCode.INVALID_ARGUMENT else None
            banned_s = self.guard.finish(peer, invalid)
            if banned_s is not None:
                log.warning("banned peer %s for %.0f s after repeated invalid messages (last on %s)", peer, banned_s, method)

        def wrap_call(behavior):
            if behavior is None:
                return None
            if inspect.isasyncgenfunction(behavior):
                async def streamed(request, context):
                    peer = await gate(context)
                    try:
                        async for item in behavior(request, context):
                            yield item
                    finally:
                        finished(peer, context)
                return streamed

            async def called(request, context):
                peer = await gate(context)
                try:
                    return await behavior(request, context)
                finally:
                    finished(peer, context)
            return called

        return handler._replace(unary_unary=wrap_call(handler.unary_unary), unary_stream=wrap_call(handler.unary_stream),
                                stream_unary=wrap_call(handler.stream_unary), stream_stream=wrap_call(handler.stream_stream))


def _host_of(peer: str) -> str:
    """"ipv4:1.2.3.4:5678" -> "1.2.3.4": without a claimed identity, limits apply per host."""
    kind, _, rest = peer.partition(":")
    host, _, _ = rest.rpartition(":")
    return host or peer
