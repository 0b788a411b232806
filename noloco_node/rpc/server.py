"""A grpc.aio server with the node's services and standard health checking.

Two listening ports: the public one speaks TLS only (the node's self-signed certificate, pinned
by clients through the signed DHT record), and a plaintext one on 127.0.0.1 that only the
node's own libp2p bridge uses (the admission interceptor refuses any other connection there)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

from noloco_node.rpc.admission import AdmissionInterceptor
from noloco_node.rpc.stage_service import GRPC_OPTIONS, StageServicer
from noloco_node.wire.v1 import diag_pb2, outer_pb2, stage_pb2

STAGE_SERVICE = "noloco.wire.v1.Stage"


class NodeServer:
    """Owns the grpc.aio server; `start` binds and returns the port actually bound."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        credentials: grpc.ServerCredentials | None,
        admission: AdmissionInterceptor | None = None,
        max_concurrent_rpcs: int | None = None,
    ) -> None:
        self.admission = admission
        self.server = grpc.aio.server(
            options=GRPC_OPTIONS,
            interceptors=[admission] if admission else None,
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.health = _StrictHealth()
        self._add(health_pb2, "Health", self.health)
        self.host, self.requested_port, self.credentials = host, port, credentials
        self.port: int | None = None
        self.bridge_port: int | None = None

    def add_stage(self, servicer: StageServicer) -> None:
        self._add(stage_pb2, "Stage", servicer)

    def add_outer(self, servicer) -> None:
        self._add(outer_pb2, "Outer", servicer)

    def add_diagnostics(self, servicer) -> None:
        self._add(diag_pb2, "Diagnostics", servicer)

    def _add(self, module, service: str, servicer) -> None:
        """Register `servicer` for every method of `service` (read from the proto descriptor).
        Not with the generated helper: its deserializers raise on undecodable bytes and gRPC
        answers INTERNAL; ours hand the servicer None, which it answers with INVALID_ARGUMENT."""
        descriptor = module.DESCRIPTOR.services_by_name[service]
        handlers = {}
        for method in descriptor.methods:
            request = message_factory.GetMessageClass(method.input_type)
            response = message_factory.GetMessageClass(method.output_type)
            kind = (
                ("stream" if method.client_streaming else "unary")
                + "_"
                + ("stream" if method.server_streaming else "unary")
            )
            make = getattr(grpc, f"{kind}_rpc_method_handler")
            handlers[method.name] = make(
                getattr(servicer, method.name),
                request_deserializer=_lenient(request.FromString),
                response_serializer=response.SerializeToString,
            )
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))

    def bind(self) -> int:
        """Bind the listening ports (before `start`), so the node knows its address before it
        builds the services that announce it; returns the public (TLS) port."""
        address = f"{self.host}:{self.requested_port}"
        if self.credentials is None:  # unit tests of the services alone
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
            self.bridge_port = self.server.add_insecure_port("127.0.0.1:0")
        if self.port == 0:
            raise OSError(f"could not bind gRPC port {self.host}:{self.requested_port} (in use? set network.port)")
        return self.port

    async def start(self) -> int:
        """Start serving (binding first if `bind` was not called); returns the public (TLS) port."""
        if self.port is None:
            self.bind()
        await self.server.start()
        for service in ("", STAGE_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    @property
    def tls_target(self) -> tuple[str, int] | None:
        """Where this host reaches our TLS listener (for relay splices delivered by the bridge)."""
        if self.credentials is None or self.port is None:
            return None
        host = self.host.strip("[]")
        return ("127.0.0.1" if host in ("0.0.0.0", "", "::") else host), self.port

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


MAX_HEALTH_WATCHES = 4
"""Watch streams open at once. They are unsigned and last as long as the caller wants, so without a
cap (found by a hostile-peer audit) 64 of them took every slot of the server's concurrent-call
limit and every peer's calls were refused until they closed."""


class _StrictHealth(health.aio.HealthServicer):
    """grpc_health's servicer, answering undecodable requests INVALID_ARGUMENT as every other
    service does (registered through `_add`, whose deserializer hands it None), and more than
    MAX_HEALTH_WATCHES watches at once RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        super().__init__()
        self.watching = 0

    async def Check(self, request, context):
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable HealthCheckRequest")
        return await super().Check(request, context)

    async def Watch(self, request, context):
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable HealthCheckRequest")
        if self.watching >= MAX_HEALTH_WATCHES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_HEALTH_WATCHES} health watches are open on this node already; ask Check instead",
            )
        self.watching += 1
        try:
            return await super().Watch(request, context)
        finally:
            self.watching -= 1


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object | None]:
    def deserialize(data: bytes) -> object | None:
        try:
            return parse(data)
        except DecodeError:
            return None

    return deserialize
