"""A backward that fails here (a non-finite input gradient, which the worker drops) frees its
microbatch's admission slot: a stage that kept it would hold one slot fewer for good, every time."""

import asyncio

import torch

from noloco_node.pipeline.ports import Hop, MicrobatchKey
from noloco_node.pipeline.runtime import StageRuntime, Ticket
from noloco_node.pipeline.runtime_settings import RuntimeHooks, StageShape
from noloco_node.pipeline.worker import NonFiniteValues
from noloco_node.runtime.compute import ComputeThread, Later
from noloco_node.runtime.faults import FaultInjector


class DroppingWorker:
    inner_steps = 0
    step_due = False

    def __init__(self, later: bool) -> None:
        self.later = later

    def backward(self, key, grad):
        def fail():
            raise NonFiniteValues(f"input gradient of {key} is not finite; the microbatch is dropped here")

        return Later(fail) if self.later else fail()


def serve_a_failing_backward(later: bool) -> dict:
    runtime = object.__new__(StageRuntime)  # only the backward's path: no server, network or directory
    runtime.shape = StageShape(stage=1, num_stages=3, boundary_width=4, seq_len=2, microbatch_size=1, vocab_size=8)
    runtime.hooks, runtime.faults = RuntimeHooks(), FaultInjector()
    runtime.worker, runtime.compute = DroppingWorker(later), ComputeThread()
    key = MicrobatchKey(origin="QmOrigin", sequence=0, attempt=0)
    ticket = Ticket(key=key, route=[Hop(peer_id="QmOrigin", address="127.0.0.1:1", stage=0)])
    runtime.in_flight = {key: ticket}
    try:
        asyncio.run(asyncio.wait_for(runtime._serve_backward(ticket, torch.zeros(1, 2, 4)), 10))
    finally:
        runtime.compute.shutdown()
    return runtime.in_flight


def test_a_backward_dropped_as_not_finite_frees_its_slot():
    assert serve_a_failing_backward(later=False) == {}


def test_a_backward_dropped_once_its_result_is_on_the_host_frees_its_slot_too():
    assert serve_a_failing_backward(later=True) == {}
