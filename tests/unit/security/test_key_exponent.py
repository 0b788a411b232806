"""An identity key is RSA of 2048 to 4096 bits with the exponent 65537: a hostile-peer audit's key
with a 2040-bit exponent was admitted, and each call signed badly with it cost ~4x the CPU of
one with 65537."""

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from noloco_node.transport.identity import IdentityError, load_public_key


def der(key: rsa.RSAPublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_65537_is_taken_and_any_other_exponent_refused():
    usual = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    assert load_public_key(der(usual)).key_size == 2048
    n = usual.public_numbers().n
    for e in (3, 2**2040 + 1):
        other = rsa.RSAPublicNumbers(e, n).public_key()
        with pytest.raises(IdentityError, match="exponent 65537"):
            load_public_key(der(other))
