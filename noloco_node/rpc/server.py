"""A grpc.aio server with the node's services and standard health checking on one port."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from noloco_node.rpc.admission import AdmissionInterceptor
from noloco_node.rpc.stage_service import GRPC_OPTIONS, StageServicer
from noloco_node.wire.v1 import diag_pb2_grpc, outer_pb2_grpc, stage_pb2

STAGE_SERVICE = "noloco.wire.v1.Stage"


class NodeServer:
    """Owns the grpc.aio server; `start` binds and returns the port actually bound."""

    def __init__(self, host: str, port: int, *, admission: AdmissionInterceptor | None = None,
                 max_concurrent_rpcs: int | None = None) -> None:
        self.admission = admission
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[admission] if admission else None,
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host, self.requested_port = host, port
        self.port: int | None = None

    def add_stage(self, servicer: StageServicer) -> None:
        # Registered by hand (not with the generated helper) so undecodable bytes reach the
        # servicer as None and get INVALID_ARGUMENT instead of gRPC's generic INTERNAL.
        handlers = {
            "Forward": grpc.stream_unary_rpc_method_handler(
                servicer.Forward, request_deserializer=_lenient(stage_pb2.ForwardMessage.FromString),
                response_serializer=stage_pb2.StageAck.SerializeToString),
            "Backward": grpc.stream_unary_rpc_method_handler(
                servicer.Backward, request_deserializer=_lenient(stage_pb2.BackwardMessage.FromString),
                response_serializer=stage_pb2.StageAck.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(STAGE_SERVICE, handlers),))

    def add_outer(self, servicer) -> None:
        outer_pb2_grpc.add_OuterServicer_to_server(servicer, self.server)

    def add_diagnostics(self, servicer) -> None:
        diag_pb2_grpc.add_DiagnosticsServicer_to_server(servicer, self.server)

    async def start(self) -> int:
        self.port = self.server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC port {self.host}:{self.requested_port} (in use? set network.port)")
        await self.server.start()
        for service in ("", STAGE_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object | None]:
    def deserialize(data: bytes) -> object | None:
        try:
            return parse(data)
        except DecodeError:
            return None
    return deserialize
