"""A libp2p peer id as text, checked with the standard library only (config stays import-light)."""

from __future__ import annotations


_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def is_peer_id(text: str) -> bool:
    """Whether `text` is a libp2p peer id in base58btc: a SHA-256 multihash (Qm...) or an identity
    multihash of a small key (12D3KooW...). Catches a mistyped character or a cut-off id before a
    daemon starts; a typo that still makes a valid id is caught only as an unreachable peer."""
    if not 0 < len(text) <= 128 or any(c not in _BASE58 for c in text):
        return False
    value = 0
    for c in text:
        value = value * 58 + _BASE58.index(c)
    raw = b"\0" * (len(text) - len(text.lstrip("1"))) + value.to_bytes((value.bit_length() + 7) // 8, "big")
    if len(raw) < 2:
        return False
    code, length = raw[0], raw[1]
    return (code == 0x12 and length == 32 or code == 0x00) and len(raw) == 2 + length
