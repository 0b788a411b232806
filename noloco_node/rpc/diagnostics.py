"""Diagnostics.Probe: a node dials an address on a peer's behalf and calls its health endpoint,
so the peer learns whether the address it announces is reachable from outside (NAT, firewall,
a wrong --announce-addr). Also the clock and version the prober sees, for `noloco-node doctor`.

A probe can only call grpc.health.v1 Check (nothing else) and at most a few run at once, so a
node cannot be turned into a relay for arbitrary traffic. Probe is served to unsigned callers in an
open swarm, so it must not be a scanner either: `address` is a plain host:port (an IP literal or a
DNS name, never one of gRPC's target schemes such as unix:), and the answer says only whether the
health check answered SERVING, in a fixed word, after the same time for every failure (gRPC's own
error text and how fast it came told a closed port from an HTTP server or a unix socket).

The target is not restricted to the caller's own observed IP ("dial me back"): a node asks over
libp2p where the prober is not directly reachable (a bootstrap serves probes over libp2p only), so
the caller's IP is the local bridge's, and an announced address may be a DNS name or a forwarded
port on another host than the one the call came from.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noloco_node.transport.tls import TLS_NAME
from noloco_node.wire.v1 import diag_pb2, diag_pb2_grpc


# What a ProbeReply's `detail` may say: nothing finer than whether the health check answered.
REACHABLE, NOT_SERVING, UNREACHABLE = "reachable", "not serving", "unreachable"
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP `host` spells (IPv6 in brackets, no zone id), else None."""
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        return None
    if (ip.version == 6) != bracketed or "%" in host:
        return None
    return ip


def _dns_name(host: str) -> bool:
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def valid_address(address: str) -> bool:
    """Whether `address` is a plain host:port: an IPv4 literal, an [IPv6] literal or a DNS name,
    and a port 1 to 65535. Never a gRPC target scheme (unix:, unix-abstract:, dns:, ipv4: ...)."""
    host, sep, port = address.rpartition(":")
    if not (sep and len(address) <= 255 and port.isdigit() and port.isascii() and 0 < int(port) < 65536):
        return False
    return _ip_literal(host) is not None or _dns_name(host)


def grpc_target(address: str) -> str:
    """The gRPC target for a valid host:port, its scheme spelled out, so that gRPC never reads the
    host as a scheme of its own (a host named `unix` would otherwise be a unix socket path)."""
    host, _, port = address.rpartition(":")
    ip = _ip_literal(host)
    if ip is None:
        return f"dns:///{host}:{port}"
    return f"ipv4:{ip}:{port}" if ip.version == 4 else f"ipv6:[{ip}]:{port}"


def _channel(address: str, cert_pem: bytes | None) -> grpc.aio.Channel:
    if cert_pem is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=cert_pem),
        options=[("grpc.ssl_target_name_override", TLS_NAME)],
    )


async def health_check(address: str, timeout_s: float, cert_pem: bytes | None = None) -> tuple[bool, str, float]:
    """Call grpc.health.v1 Check on `address` (over TLS trusting only `cert_pem`, when given);
    returns (serving, detail, round trip seconds)."""
    start = time.monotonic()
    async with _channel(address, cert_pem) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}", time.monotonic() - start
    rtt = time.monotonic() - start
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return (
        serving,
        "" if serving else f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
        rtt,
    )


def other_run(errors: list[str]) -> str | None:
    """The run a peer serves, when it refused a probe for serving another one (Probe's refusal below)."""
    for error in errors:
        if (found := re.search(r"this node serves run '([^']*)'", error)) is not None:
            return found.group(1)
    return None


class DiagnosticsServicer(diag_pb2_grpc.DiagnosticsServicer):
    def __init__(
        self, *, run_id: str, version: str, manifest_hash: str, timeout_s: float, max_concurrent: int = 4
    ) -> None:
        self.run_id, self.version, self.manifest_hash, self.timeout_s = run_id, version, manifest_hash, timeout_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self.probes = 0

    async def Probe(self, request: diag_pb2.ProbeRequest, context: grpc.aio.ServicerContext) -> diag_pb2.ProbeReply:
        arrived = time.time()
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable ProbeRequest")
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node serves run {self.run_id!r}")
        if not valid_address(request.address):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"address {request.address[:80]!r} is not a plain host:port "
                "(an IPv4 literal, an [IPv6] literal or a DNS name; port 1 to 65535; no scheme)",
            )
        if self._slots.locked():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many probes in flight; retry later")
        cert_pem = None
        if request.tls_cert:
            try:
                from cryptography import x509
                from cryptography.hazmat.primitives import serialization

                cert_pem = x509.load_der_x509_certificate(request.tls_cert).public_bytes(serialization.Encoding.PEM)
            except ValueError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tls_cert is not a DER certificate")
        start = time.monotonic()
        async with self._slots:
            self.probes += 1
            reachable, detail, rtt = await self._probe(request.address, cert_pem)
        if detail == UNREACHABLE:  # the wait is out of the slot: it holds no dial, only the answer
            await asyncio.sleep(max(0.0, start + self.timeout_s - time.monotonic()))
            rtt = time.monotonic() - start
        return diag_pb2.ProbeReply(
            reachable=reachable,
            detail=detail,
            rtt_s=rtt,
            server_time=arrived,
            version=self.version,
            manifest_hash=self.manifest_hash,
        )

    async def _probe(self, address: str, cert_pem: bytes | None) -> tuple[bool, str, float]:
        """The health check of `address` as the caller may see it: `reachable`, `not serving` (a
        health service answered otherwise), or `unreachable` for every other outcome, which Probe
        answers only once the whole timeout has passed, so neither its words nor its time tell a
        closed port from a silent one, an HTTP server or a TLS endpoint with another identity."""
        serving, detail, rtt = await health_check(grpc_target(address), self.timeout_s, cert_pem)
        if serving:
            return True, REACHABLE, rtt
        return False, NOT_SERVING if detail.startswith("health status") else UNREACHABLE, rtt


@dataclass(frozen=True)
class ProbeResult:
    prober: str
    reachable: bool
    detail: str
    skew_s: float
    """The prober's clock minus ours (estimated at the midpoint of the call)."""
    version: str
    manifest_hash: str


async def ask_probe(
    prober: str, *, address: str, run_id: str, timeout_s: float, dialer, tls_cert: bytes = b""
) -> ProbeResult:
    """Ask the peer `prober` (a peer id, dialled through `dialer`) to health-check `address`,
    pinning `tls_cert`. Raises grpc.aio.AioRpcError or NodeError when the prober cannot be asked."""
    channel, _ = await dialer.channel(prober)
    sent = time.time()
    reply = await diag_pb2_grpc.DiagnosticsStub(channel).Probe(
        diag_pb2.ProbeRequest(run_id=run_id, address=address, tls_cert=tls_cert), timeout=2 * timeout_s + 1
    )
    received = time.time()
    # The prober stamped its clock on arrival, then spent rtt_s probing: half of the rest is one way.
    one_way = max(0.0, received - sent - reply.rtt_s) / 2
    return ProbeResult(
        prober, reply.reachable, reply.detail, reply.server_time - (sent + one_way), reply.version, reply.manifest_hash
    )


async def probe_from_peers(
    address: str, probers: list[str], *, run_id: str, timeout_s: float, dialer, tls_cert: bytes = b"", wanted: int = 2
) -> tuple[list[ProbeResult], list[str]]:
    """Ask up to `wanted` of `probers` (peer ids, tried in order) to health-check `address`;
    returns the answers and the errors of the probers that could not be asked."""
    from noloco_node.errors import NodeError

    results, errors = [], []
    for prober in probers:
        if len(results) >= wanted:
            break
        try:
            results.append(
                await ask_probe(
                    prober, address=address, run_id=run_id, timeout_s=timeout_s, dialer=dialer, tls_cert=tls_cert
                )
            )
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{prober[-8:]}: {exc.code().name} {exc.details()}")
        except NodeError as exc:
            errors.append(f"{prober[-8:]}: {exc}")
    return results, errors
