"""Every outer-round case of tests/outer_cases.py (the V1/V2 vectors, both snapshot forms, each
codec on the wire, top-k's residual, three replicas, hostile partners, a lone peer) on peers in this
process over the in-memory pairing twin: the same arguments, state and round loop as the peer
processes of tests/integration/test_outer_exchange.py."""

import pytest

from tests.outer_cases import *  # noqa: F401,F403 - the cases are collected here
from tests.outer_peers import MemoryPeers


@pytest.fixture
def peers(tmp_path):
    p = MemoryPeers(tmp_path)
    yield p
    p.stop()
