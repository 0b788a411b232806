"""The one place that maps node errors to gRPC status codes and back.

A servicer refuses a call with `abort_with(context, error)`: the status code `TO_STATUS` gives the
error's class, its message as the details, and its `code` (errors.py: "unknown-microbatch",
"invalid-payload", ...) in the trailing metadata key `noloco-error`
(proto/README.md: Notes for client authors). A client reads a failed call back with
`error_from_rpc`: the status code says which error it is, and the `noloco-error` key tells apart
the errors that share a code (`DISTINGUISHED`: an unknown microbatch from another
FAILED_PRECONDITION), never the message text.
"""

from __future__ import annotations

import grpc

from noloco_node.errors import (
    InvalidPayload,
    NodeError,
    NothingToTopUp,
    PeerBusy,
    PeerUnavailable,
    ProtocolMismatch,
    TooLarge,
    UnknownMicrobatch,
)

TO_STATUS: dict[type[NodeError], grpc.StatusCode] = {
    PeerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidPayload: grpc.StatusCode.INVALID_ARGUMENT,
    ProtocolMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    # Not NOT_FOUND: a backward for a microbatch we hold no input for is a request in the wrong
    # state, and the four codes a peer can earn stay INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
    # FAILED_PRECONDITION / UNAUTHENTICATED.
    UnknownMicrobatch: grpc.StatusCode.FAILED_PRECONDITION,
    NothingToTopUp: grpc.StatusCode.FAILED_PRECONDITION,
    PeerUnavailable: grpc.StatusCode.UNAVAILABLE,
}
ERROR_KEY = "noloco-error"
"""Trailing metadata key of a refusal: the node error's `code`."""
# What a client makes of each status code, and the errors it tells apart from that one by the
# `noloco-error` detail (the rest stay the code's error, whatever the detail says: a peer's
# detail refines its status, it never turns one kind of refusal into another).
_FROM_STATUS: dict[grpc.StatusCode, type[NodeError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: PeerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPayload,
    grpc.StatusCode.FAILED_PRECONDITION: ProtocolMismatch,
}
DISTINGUISHED: tuple[type[NodeError], ...] = (UnknownMicrobatch, NothingToTopUp)


def status_of(error: NodeError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in TO_STATUS:
            return TO_STATUS[cls]
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, error: NodeError) -> None:
    """End the call being served (gRPC's abort raises) with `error`'s status, message and typed detail."""
    await context.abort(status_of(error), str(error), trailing_metadata=((ERROR_KEY, error.code),))


LOST_REFUSAL = "Internal error from Core"
"""What grpc.aio's client reports, as INTERNAL, when the server ended a client-streaming call
while we were still writing it (grpc/grpc#36066): the server's own status is lost. A node ends a
call early only to refuse it, most often as busy (8 concurrent 8 MiB Forwards to a refusing server
here: 3 of 80 came back so, the rest RESOURCE_EXHAUSTED)."""


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> NodeError:
    """A client-side AioRpcError as the node error the caller can act on. A refusal whose status
    gRPC lost (LOST_REFUSAL) is PeerBusy: the caller tries another replica, and does not ban the
    one it asked (a newcomer's stage 0 banned the only stage-1 replica for up to 8 s so)."""
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INTERNAL and detail == LOST_REFUSAL:
        return PeerBusy(f"{peer}: ended the call before it was sent whole (a refusal whose status gRPC lost)")
    cls = _FROM_STATUS.get(code)
    if cls is None:
        return unavailable_from_rpc(exc, peer)
    typed = _detail(exc)
    cls = next((d for d in DISTINGUISHED if d.code == typed and TO_STATUS[d] == code), cls)
    if cls is InvalidPayload:
        return InvalidPayload(f"{peer} rejected our payload: {detail}")
    return cls(f"{peer}: {detail}")


def unavailable_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> PeerUnavailable:
    """A call that failed whatever its status code: the partner of an outer exchange or a state
    transfer that ended it, or a status no node error maps to. The code stays in the message."""
    return PeerUnavailable(f"{peer}: {exc.code().name} {exc.details() or ''}".strip())


def _detail(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_KEY and isinstance(value, str):
            return value
    return ""
