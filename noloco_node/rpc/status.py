"""The one place that maps node errors to gRPC status codes and back."""

from __future__ import annotations

import grpc

from noloco_node.errors import (InvalidPayload, NodeError, PeerBusy, PeerUnavailable, ProtocolMismatch, TooLarge,
                                UnknownMicrobatch)

TO_STATUS: dict[type[NodeError], grpc.StatusCode] = {
    PeerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidPayload: grpc.StatusCode.INVALID_ARGUMENT,
    ProtocolMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    # Not NOT_FOUND: a backward for a microbatch we hold no input for is a request in the wrong
    # state, and the four codes a peer can earn stay INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
    # FAILED_PRECONDITION / UNAUTHENTICATED.
    UnknownMicrobatch: grpc.StatusCode.FAILED_PRECONDITION,
    PeerUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: NodeError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in TO_STATUS:
            return TO_STATUS[cls]
    return grpc.StatusCode.INTERNAL


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> NodeError:
    """A client-side AioRpcError as the node error the caller can act on."""
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PeerBusy(f"{peer}: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPayload(f"{peer} rejected our payload: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if detail.startswith("no saved input"):
            return UnknownMicrobatch(f"{peer}: {detail}")
        return ProtocolMismatch(f"{peer}: {detail}")
    return PeerUnavailable(f"{peer}: {code.name} {detail}".strip())
