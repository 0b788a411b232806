"""Client helpers for tests that call a node's gRPC services by hand, the way a peer does: over
TLS pinning the certificate the node published (its ready file's `tls_cert`, the same base64 DER
as its DHT record), with every call signed for that node (transport/credentials.py).

`info` is a node's ready JSON (`NodeProcess.info`): at least "address", "peer_id" and "tls_cert".
"""

from __future__ import annotations

import threading

import grpc

from noloco_node.transport.credentials import CallSigner
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.tls import pem_from_record, pinned_credentials


def cert_pem(info: dict) -> bytes:
    """The node's certificate (PEM), from what it published."""
    return pem_from_record(info["tls_cert"])


def _credentials(info: dict, options) -> tuple[grpc.ChannelCredentials, list]:
    creds, extra = pinned_credentials(cert_pem(info))
    return creds, list(options) + extra


def secure_channel(info: dict, options=()) -> grpc.Channel:
    """A sync channel to the node's public port that trusts only the node's own certificate."""
    creds, opts = _credentials(info, options)
    return grpc.secure_channel(info["address"], creds, options=opts)


def aio_secure_channel(info: dict, options=()) -> grpc.aio.Channel:
    """The same, for grpc.aio."""
    creds, opts = _credentials(info, options)
    return grpc.aio.secure_channel(info["address"], creds, options=opts)


def signed(
    identity: NodeIdentity, method: str, info: dict | str, key: bytes | None = None, now: float | None = None
) -> list[tuple[str, str]]:
    """Metadata of ONE call to `method` on the node `info` (or the peer id given), signed by
    `identity` (and MACed with the swarm `key`, if any). Tokens are one-time: make one per call."""
    audience = info if isinstance(info, str) else info["peer_id"]
    return CallSigner(identity, key).metadata(method, audience, now=now)


class IdentityPool:
    """A few pre-generated identities (each costs ~66 ms of RSA key generation), handed out in turn."""

    def __init__(self, size: int) -> None:
        self.identities = [NodeIdentity.generate() for _ in range(size)]
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.identities)

    def __getitem__(self, i: int) -> NodeIdentity:
        return self.identities[i % len(self.identities)]

    def take(self) -> NodeIdentity:
        with self._lock:
            identity = self.identities[self._next % len(self.identities)]
            self._next += 1
        return identity
