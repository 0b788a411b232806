"""A payload's total deadline holds while chunks keep coming. Found by a hostile-peer audit: a 64 KiB
forward in 65,536 one-byte chunks ran 17 s against a 10 s deadline (and 10 s of the node's CPU),
because `asyncio.wait_for` (each chunk's progress deadline) on Python 3.11 returns a message that
arrived as the enclosing deadline cancelled it, and the cancellation was lost."""

import asyncio

import pytest

from noloco_node.codec.spec import TensorSpec
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.deadlines import within
from noloco_node.rpc.stage_service import StageServicer
from noloco_node.wire.v1 import stage_pb2, tensor_pb2

PAYLOAD = 1 << 16  # the audit's size: at 1 byte a chunk, it takes seconds to send


async def one_byte_chunks(limit_s: float):
    """A caller that always has the next chunk ready (it never stalls), for at most `limit_s`."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + limit_s
    index = 0
    while loop.time() < ends and index < PAYLOAD:
        yield stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(index=index, data=b"\0"))
        index += 1
        await asyncio.sleep(0)


async def test_a_stream_of_tiny_chunks_is_cut_at_its_total_deadline():
    servicer = StageServicer(None, run=ServedRun("run", "hash"), max_payload_bytes=PAYLOAD, receive_s=0.05)
    servicer.min_bytes_per_s = 1e12  # the link term alone: a fraction of a second for 64 KiB
    spec = TensorSpec(dtype="float32", shape=(1, 1, PAYLOAD // 4), codec="none", payload_bytes=PAYLOAD)
    deadline_s = servicer._payload_deadline(0.0, spec, "")
    assert deadline_s < 1.0
    loop = asyncio.get_running_loop()
    for attempt in range(10):
        started = loop.time()
        with pytest.raises(TimeoutError):
            await servicer._payload(one_byte_chunks(limit_s=deadline_s + 3.0), started, spec)
        waited = loop.time() - started
        assert waited < deadline_s + 0.5, (
            f"attempt {attempt}: the {deadline_s:.2f} s deadline held after {waited:.2f} s"
        )


async def test_a_progress_deadline_inside_a_total_one_does_not_hide_it():
    async def ready_soon() -> int:
        await asyncio.sleep(0)
        return 1

    loop = asyncio.get_running_loop()
    for attempt in range(20):
        started, reads = loop.time(), 0
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                while reads < 100_000:
                    reads += await within(ready_soon(), 5.0, "reading")
        assert loop.time() - started < 0.5 and reads < 100_000, attempt
