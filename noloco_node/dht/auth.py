"""hivemind's authorizer hook with the swarm key: every DHT request and response carries an
HMAC-SHA256 over the message under the key, a timestamp and a nonce. A peer without the key
gets no answer from us (hivemind drops requests that fail `validate_request`), and its answers
to our requests are ignored, so it can neither read through us nor store records on us.

The same key as the gRPC admission (rpc/admission.py); only the message format differs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time


def _mac(key: bytes, message) -> bytes:
    return hmac.new(key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()


class SwarmKeyAuthorizer(AuthorizerBase):
    def __init__(self, key: bytes, *, max_skew_s: float = 60.0) -> None:
        self.key, self.max_skew_s = key, max_skew_s
        self._seen_nonces = TimedStorage()  # a replayed request inside the skew window is refused
        self.refused = 0

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key=None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = _mac(self.key, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature = auth.signature
        auth.signature = b""
        ok = (
            abs(auth.time - get_dht_time()) <= self.max_skew_s
            and len(auth.nonce) == 16
            and auth.nonce not in self._seen_nonces
            and hmac.compare_digest(signature, _mac(self.key, request))
        )
        auth.signature = signature
        if ok:
            self._seen_nonces.store(auth.nonce, None, get_dht_time() + 2 * self.max_skew_s)
        else:
            self.refused += 1
        return ok

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = _mac(self.key, response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        signature = auth.signature
        auth.signature = b""
        ok = auth.nonce == request.auth.nonce and hmac.compare_digest(signature, _mac(self.key, response))
        auth.signature = signature
        return ok
