"""A gradient whose upstream peer is not (yet) in the DHT, or did not answer, is sent again a few
times before it is given up; a refusal is given up at once (the upstream re-issues after its timeout)."""

import asyncio

import pytest
import torch

from noloco_node.errors import InvalidPayload, PeerUnavailable, PeerUnknown
from noloco_node.pipeline import runtime as runtime_module
from noloco_node.pipeline.ports import Hop, MicrobatchKey
from noloco_node.pipeline.runtime import RuntimeStats, StageRuntime


class FlakyTransport:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.attempts = list(failures), 0

    async def backward(self, peer_id, **_):
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)


def send(transport: FlakyTransport, accepting: bool = True) -> RuntimeStats:
    runtime = object.__new__(StageRuntime)  # only the send path: no worker, server or directory
    runtime.transport, runtime.stats, runtime.accepting = transport, RuntimeStats(), accepting
    key = MicrobatchKey(origin="QmOrigin", sequence=0, attempt=0)
    asyncio.run(
        runtime._send_backward(Hop(peer_id="QmOrigin", address="127.0.0.1:1", stage=0), key, torch.zeros(1), 0.0, 1)
    )
    return runtime.stats


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(runtime_module, "BACKWARD_RETRIES_S", (0.0, 0.0, 0.0))


def test_a_peer_that_appears_in_the_dht_gets_its_gradient():
    transport = FlakyTransport([PeerUnknown("no record"), PeerUnknown("no record")])
    stats = send(transport)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (3, 1, 0)


def test_a_peer_that_never_appears_is_given_up_after_the_retries():
    transport = FlakyTransport([PeerUnknown("no record")] * 10)
    stats = send(transport)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (4, 0, 1)


def test_a_peer_whose_path_comes_back_gets_its_gradient():
    # A NAT audit: a relay's restart broke the path for seconds; gradients given up at once left
    # stage 0 waiting out its 60 s microbatch timeout.
    transport = FlakyTransport([PeerUnavailable("Handshake read failed")] * 2)
    stats = send(transport)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (3, 1, 0)


def test_a_peer_that_never_answers_is_given_up_after_the_retries():
    transport = FlakyTransport([PeerUnavailable("connection refused")] * 10)
    stats = send(transport)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (4, 0, 1)


def test_a_refusal_is_not_retried():
    transport = FlakyTransport([InvalidPayload("not a gradient of ours")])
    stats = send(transport)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (1, 0, 1)


def test_a_draining_node_gives_a_gradient_up_at_once():
    transport = FlakyTransport([PeerUnavailable("connection refused")] * 10)
    stats = send(transport, accepting=False)
    assert (transport.attempts, stats.backwards_sent, stats.send_failures) == (1, 0, 1)
