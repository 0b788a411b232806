"""gRPC channels whose every call is signed for the peer it is meant for."""

from __future__ import annotations

import grpc

from noloco_node.transport.credentials import CallSigner


def _with_identity(
    signer: CallSigner, audience: str, details: grpc.aio.ClientCallDetails
) -> grpc.aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    metadata = list(details.metadata or ()) + signer.metadata(method, audience)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, signer: CallSigner, audience: str) -> None:
        self.signer, self.audience = signer, audience

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_identity(self.signer, self.audience, details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, signer: CallSigner, audience: str) -> None:
        self.signer, self.audience = signer, audience

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_identity(self.signer, self.audience, details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, signer: CallSigner, audience: str) -> None:
        self.signer, self.audience = signer, audience

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_identity(self.signer, self.audience, details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, signer: CallSigner, audience: str) -> None:
        self.signer, self.audience = signer, audience

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_identity(self.signer, self.audience, details), request_iterator)


def open_channel(
    target: str,
    signer: CallSigner | None,
    audience: str = "",
    *,
    credentials: tuple[grpc.ChannelCredentials, list] | None = None,
    options: list | None = None,
) -> grpc.aio.Channel:
    """A channel whose every call is signed for `audience` (the peer id we expect to answer).
    With `credentials` (transport/tls.py: pinned certificate, name override) it is TLS."""
    interceptors = None
    if signer is not None:
        interceptors = [cls(signer, audience) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    options = list(options or [])
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    creds, extra = credentials
    return grpc.aio.secure_channel(target, creds, options=options + extra, interceptors=interceptors)
