"""TLS for direct gRPC links without a certificate authority.

Each node makes a fresh self-signed certificate at start and publishes it inside its signed DHT
record, so the certificate is bound to the peer id that signed the record. A client pins exactly
that certificate (it is the only root it trusts for that peer), so only the holder of the matching
private key can complete the handshake: nothing for a volunteer to manage, no CA to trust.
Every node's certificate names the same host, TLS_NAME; the pin, not the name, is what is checked.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TLS_NAME = "noloco-node"
MAX_CERT_DER_BYTES = 2048


class CertificateError(ValueError):
    pass


@dataclass(frozen=True)
class NodeCertificate:
    key_pem: bytes
    cert_pem: bytes
    cert_der: bytes

    @classmethod
    def generate(cls, days: int = 3650) -> NodeCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))  # tolerate peers whose clock is behind
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        )
        cert = builder.sign(key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(
            key_pem=key_pem,
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            cert_der=cert.public_bytes(serialization.Encoding.DER),
        )

    @property
    def b64(self) -> str:
        """The certificate as it sits in the DHT record."""
        return base64.b64encode(self.cert_der).decode()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_der)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def fingerprint(cert_der: bytes) -> str:
    """SHA-256 of the DER certificate, hex, as `status` shows it."""
    return hashlib.sha256(cert_der).hexdigest()


def pem_from_record(cert_b64: str) -> bytes:
    """The PEM of a certificate published in a record; raises CertificateError if it is not one."""
    try:
        der = base64.b64decode(cert_b64, validate=True)
    except (ValueError, TypeError):
        raise CertificateError("record certificate is not base64") from None
    if not der or len(der) > MAX_CERT_DER_BYTES:
        raise CertificateError(f"record certificate of {len(der)} bytes (limit {MAX_CERT_DER_BYTES})")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise CertificateError(f"record certificate does not parse: {exc}") from None
    return cert.public_bytes(serialization.Encoding.PEM)


def pinned_credentials(cert_pem: bytes) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """Channel credentials that trust only `cert_pem`, and the option naming the host it is for."""
    return grpc.ssl_channel_credentials(root_certificates=cert_pem), [("grpc.ssl_target_name_override", TLS_NAME)]
