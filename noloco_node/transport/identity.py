"""A node's one identity: an RSA key that is at once its libp2p key (so its libp2p peer id is
derived from it and every libp2p handshake proves it), the key that signs its DHT record (hivemind's
RSASignatureValidator puts the public key in the record's subkey), and the key that signs its gRPC
calls. Anyone can check that a record or a call comes from the peer id it names: hash the public
key the way libp2p does and compare.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
from pathlib import Path

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from noloco_node.errors import IdentityError

_PADDING = padding.PKCS1v15()
_HASH = hashes.SHA256()
_OWNER_RE = re.compile(rb"^\[owner:(.+?)\]$")


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: sha2-256 multihash of its protobuf form."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def load_public_key(der: bytes) -> rsa.RSAPublicKey:
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"not a DER public key: {exc}") from None
    if not isinstance(key, rsa.RSAPublicKey) or not 2048 <= key.key_size <= 4096:
        raise IdentityError("identity keys are RSA keys of 2048 to 4096 bits")
    if key.public_numbers().e != 65537:
        # What libp2p and hivemind generate; a 2040-bit exponent made each signature check ~4x dearer
        # (a hostile-peer audit's flood of badly signed calls).
        raise IdentityError("identity keys have the public exponent 65537")
    return key


def peer_id_of_owner_marker(subkey: bytes) -> str | None:
    """The peer id proven by a DHT subkey `[owner:ssh-rsa ...]` (RSASignatureValidator's marker),
    or None when the subkey is not such a marker."""
    match = _OWNER_RE.match(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, TypeError):
        return None
    return peer_id_of(key) if isinstance(key, rsa.RSAPublicKey) else None


def verify(public_key: rsa.RSAPublicKey, data: bytes, signature: bytes) -> bool:
    try:
        public_key.verify(signature, data, _PADDING, _HASH)
        return True
    except (InvalidSignature, ValueError):
        return False


class NodeIdentity:
    """The private key, the peer id it proves, and the libp2p identity file p2pd reads."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self.private_key = private_key
        self.public_key = private_key.public_key()
        self.peer_id = peer_id_of(self.public_key)
        self.public_der = self.public_key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public_b64 = base64.b64encode(self.public_der).decode()
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._identity_path: str | None = None

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def from_file_or_fresh(cls, path: str | Path | None) -> NodeIdentity:
        """`security.identity_file`: kept there (same peer id across restarts) when set, else fresh."""
        return cls.load_or_create(path) if path else cls.generate()

    @classmethod
    def load_or_create(cls, path: str | Path) -> NodeIdentity:
        """A persistent identity (hivemind's identity file format): same peer id across restarts."""
        path = Path(path).expanduser()
        if path.is_dir():
            example = path / "node.key"
            raise IdentityError(f"{path} is a folder, not an identity file; pass a file's path, e.g. {example}")
        if not path.exists():
            identity = cls.generate()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(identity.libp2p_key_bytes())
            identity._identity_path = str(path)
            return identity
        new_one = "pass the right file, or remove this one to create a new identity (a new peer id: a new multiaddr)"
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read the identity file {path} ({exc.strerror}); {new_one}") from None
        try:
            der = crypto_pb2.PrivateKey.FromString(raw).data
            key = serialization.load_der_private_key(der, password=None)
        except Exception:  # noqa: BLE001 - any file that is not a key gets the same clear error
            what = f"{len(raw)} bytes that hold no key"
            raise IdentityError(f"{path} is not an identity file ({what}); {new_one}") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"{path} does not hold an RSA key; {new_one}")
        identity = cls(key)
        identity._identity_path = str(path)
        return identity

    def libp2p_key_bytes(self) -> bytes:
        der = self.private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()

    def identity_path(self) -> str:
        """A file p2pd can read this key from (kept in a private temp dir unless loaded from one)."""
        if self._identity_path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="noloco-id-")
            path = Path(self._tmpdir.name) / "libp2p.key"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.libp2p_key_bytes())
            self._identity_path = str(path)
            assert PeerID.from_identity(path.read_bytes()).to_base58() == self.peer_id
        return self._identity_path

    def hivemind_key(self) -> RSAPrivateKey:
        """The same key as hivemind's RSAPrivateKey, for RSASignatureValidator."""
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__(
            {
                "_private_key": self.private_key.private_bytes(
                    serialization.Encoding.DER,
                    serialization.PrivateFormat.TraditionalOpenSSL,
                    serialization.NoEncryption(),
                )
            }
        )
        return key

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data, _PADDING, _HASH)

    def close(self) -> None:
        """Remove the temp key file; a later identity_path() writes it again (a node that moves
        between stages restarts its daemon with the same key)."""
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
            self._identity_path = None
