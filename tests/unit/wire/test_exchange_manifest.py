"""An outer snapshot's manifest that announces more bytes than the stage's limit is refused when it
arrives (INVALID_ARGUMENT), not left to stretch the exchange's total deadline to the ceiling (an
hour) while the tensors trickle: found by a hostile-peer audit (a manifest of 10^15 bytes)."""

import pytest

from noloco_node.errors import InvalidPayload
from noloco_node.rpc.deadlines import ExchangeLimits, Progress
from noloco_node.rpc.exchange import _ExchangeStream
from noloco_node.sync.ports import EncodedSnapshot, ExpectedTensor
from noloco_node.wire.v1 import outer_pb2

EXPECTED = [ExpectedTensor(name="w", shape=(4,), dtype="float32")]


def stream_with(manifest_bytes: int) -> _ExchangeStream:
    messages = [
        outer_pb2.ExchangeMessage(manifest=outer_pb2.SnapshotManifest(num_tensors=1, payload_bytes=manifest_bytes))
    ]

    async def read():
        return messages.pop(0)

    async def write(_message) -> None:
        pass

    return _ExchangeStream(read, write, Progress(stall_s=5.0), traffic=None, faults=None)


async def test_a_manifest_over_the_limit_is_refused_on_arrival():
    deadlines: list[int] = []
    limits = ExchangeLimits(total_s=lambda n: deadlines.append(n) or 10.0, stall_s=5.0)
    with pytest.raises(InvalidPayload, match="announces 1000000000000000 bytes; the limit is 64"):
        await stream_with(10**15).receive(EncodedSnapshot(tensors=[]), EXPECTED, "none", 64, limits)
    assert deadlines == []  # refused before it set any deadline


async def test_a_manifest_within_the_limit_goes_on_to_its_tensors():
    limits = ExchangeLimits(total_s=lambda n: 10.0, stall_s=5.0)
    with pytest.raises(IndexError):  # past the manifest: the scripted stream has no tensor to give
        await stream_with(16).receive(EncodedSnapshot(tensors=[]), EXPECTED, "none", 64, limits)


async def test_a_manifest_announcing_more_than_this_rounds_snapshots_is_refused_on_arrival():
    """Both sides send the same form and codecs of the same parameters: the same bytes. A hostile
    peer's manifest 8x the real size stretched an exchange's deadline from ~14 s to 62.7 s."""
    ours = EncodedSnapshot(tensors=[("w", None, b"\0" * 100_000)])
    deadlines: list[int] = []
    limits = ExchangeLimits(total_s=lambda n: deadlines.append(n) or 10.0, stall_s=5.0)
    with pytest.raises(InvalidPayload, match="announces 800000 bytes; this round's snapshots are 100000"):
        await stream_with(800_000).receive(ours, EXPECTED, "none", 10**9, limits)
    assert deadlines == []
    with pytest.raises(IndexError):  # the same size goes on to its tensors
        await stream_with(100_000).receive(ours, EXPECTED, "none", 10**9, limits)
