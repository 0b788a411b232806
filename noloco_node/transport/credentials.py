"""Per-call proof of identity: who is calling, proven by a signature, and never replayable.

Every call carries, in its metadata,
    x-noloco-auth: <peer id>.<unix ms>.<nonce, 32 hex>.<signature, base64url>
    x-noloco-key:  <the caller's RSA public key, DER, base64>
    x-noloco-mac:  <HMAC-SHA256 hex under the swarm key>            (only in a keyed swarm)
where the signature (RSA PKCS#1 v1.5, SHA-256, by the caller's identity key) and the MAC cover
    "noloco-call-v2\\n<peer id>\\n<audience peer id>\\n<method>\\n<unix ms>\\n<nonce>".
The server accepts a token only if the key hashes to the named peer id (libp2p's rule), the
signature checks out, the audience is itself, the time is within the allowed skew, and the nonce
has not been seen within that window. So a token works once, on one server, for one method: a
captured or replayed token is refused, and a peer can act only under the id its key proves.
The links themselves are encrypted (TLS or libp2p), so tokens are not visible on the wire.
"""

from __future__ import annotations

import base64
import re
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

from cryptography.hazmat.primitives.asymmetric import rsa

from noloco_node.transport.identity import IdentityError, NodeIdentity, load_public_key, peer_id_of, verify

AUTH_HEADER = "x-noloco-auth"
KEY_HEADER = "x-noloco-key"
MAC_HEADER = "x-noloco-mac"
_MAX_KEY_B64 = 1024
# <unix ms>.<nonce: 32 lower-case hex>.<signature: base64url, padded>, as proto/README.md writes them.
_TOKEN_PARTS = re.compile(r"[0-9]{1,16}\.[0-9a-f]{32}\.[A-Za-z0-9_-]+={0,2}")


class CallAuthError(ValueError):
    """A call's credentials are missing or do not check out (the message says which)."""


def _message(peer_id: str, audience: str, method: str, stamp_ms: int, nonce: str) -> bytes:
    return f"noloco-call-v2\n{peer_id}\n{audience}\n{method}\n{stamp_ms}\n{nonce}".encode()


def _mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class CallSigner:
    """Makes the metadata of one outgoing call."""

    def __init__(self, identity: NodeIdentity, swarm_key: bytes | None = None) -> None:
        self.identity, self.swarm_key = identity, swarm_key

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def metadata(self, method: str, audience: str, now: float | None = None) -> list[tuple[str, str]]:
        stamp_ms = int((time.time() if now is None else now) * 1000)
        nonce = secrets.token_hex(16)
        message = _message(self.identity.peer_id, audience, method, stamp_ms, nonce)
        signature = base64.urlsafe_b64encode(self.identity.sign(message)).decode()
        out = [
            (AUTH_HEADER, f"{self.identity.peer_id}.{stamp_ms}.{nonce}.{signature}"),
            (KEY_HEADER, self.identity.public_b64),
        ]
        if self.swarm_key is not None:
            out.append((MAC_HEADER, _mac(self.swarm_key, message)))
        return out


class CallVerifier:
    """Checks incoming tokens; remembers nonces for twice the skew window and a bounded number
    of public keys, so neither table grows with what peers send."""

    def __init__(
        self,
        audience: str,
        *,
        swarm_key: bytes | None,
        max_skew_s: float,
        max_keys: int = 4096,
        max_nonces: int = 200_000,
    ) -> None:
        self.audience, self.swarm_key, self.max_skew_s = audience, swarm_key, max_skew_s
        self.max_keys, self.max_nonces = max_keys, max_nonces
        self._keys: OrderedDict[str, rsa.RSAPublicKey] = OrderedDict()
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self.replays = 0

    def _public_key(self, peer_id: str, key_b64: str | None) -> rsa.RSAPublicKey:
        key = self._keys.get(peer_id)
        if key is not None:
            self._keys.move_to_end(peer_id)
            return key
        if not key_b64 or len(key_b64) > _MAX_KEY_B64:
            raise CallAuthError(f"missing or oversized {KEY_HEADER}")
        try:
            key = load_public_key(base64.b64decode(key_b64, validate=True))
        except (IdentityError, ValueError) as exc:
            raise CallAuthError(f"bad {KEY_HEADER}: {exc}") from None
        if peer_id_of(key) != peer_id:
            raise CallAuthError(f"the key in {KEY_HEADER} does not belong to peer {peer_id[:64]!r}")
        self._keys[peer_id] = key
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return key

    def _remember(self, nonce: str, now: float) -> None:
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        if len(self._nonces) >= self.max_nonces:
            # Forgetting a live nonce early would let its token be replayed: refuse instead.
            raise CallAuthError("too many calls within the replay window; retry shortly")
        self._nonces[nonce] = now + 2 * self.max_skew_s

    def verify(self, metadata: dict[str, str], method: str, now: float | None = None) -> str:
        """The caller's proven peer id; raises CallAuthError saying what is wrong."""
        token = metadata.get(AUTH_HEADER)
        if not token:
            raise CallAuthError("unsigned call: this method needs x-noloco-auth (see proto/README.md: Signed calls)")
        parts = token.split(".")
        if len(parts) != 4 or not _TOKEN_PARTS.fullmatch(".".join(parts[1:])) or not 0 < len(parts[0]) <= 128:
            raise CallAuthError("malformed x-noloco-auth token")
        peer_id, stamp, nonce, signature_b64 = parts
        now = time.time() if now is None else now
        skew = abs(now - int(stamp) / 1000)
        if skew > self.max_skew_s:
            raise CallAuthError(
                f"token time is {skew:.1f} s from ours (limit {self.max_skew_s:g} s): check the clock (NTP)"
            )
        message = _message(peer_id, self.audience, method, int(stamp), nonce)
        if self.swarm_key is not None:
            if not hmac.compare_digest(metadata.get(MAC_HEADER, ""), _mac(self.swarm_key, message)):
                raise CallAuthError(
                    "token does not check out under this swarm's key: a wrong swarm key "
                    "(security.swarm_key_file), or a token made for another node, method or time"
                )
        key = self._public_key(peer_id, metadata.get(KEY_HEADER))
        try:  # the alphabet was checked above: no standard-base64 "+" or "/", no stray characters
            signature = base64.urlsafe_b64decode(signature_b64)
        except ValueError:
            raise CallAuthError("token signature is not base64url") from None
        if not verify(key, message, signature):
            raise CallAuthError("token signature does not verify (made for another node or method, or forged)")
        if nonce in self._nonces:
            self.replays += 1
            raise CallAuthError("token already used (replay)")
        self._remember(nonce, now)
        return peer_id
