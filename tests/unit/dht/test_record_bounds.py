"""What a record may say and still be shown: found by a hostile-peer audit, a record filed under
stage 1's key that said stage 0 was listed and counted among stage 0's replicas, and a version of
5,000 characters was shown on the public swarm page."""

import time

import pydantic.v1 as pydantic
import pytest

from noloco_node.dht.directory import PeerDirectory
from noloco_node.dht.records import StageRecord
from tests.unit.dht.record_sample import record


class Directory(PeerDirectory):
    def __init__(self, entries: dict[int, list]) -> None:  # no DHT: the entries a lookup would find
        self.entries = entries

    async def _entries(self, stage: int):
        return [(f"owner-{i}", value) for i, value in enumerate(self.entries.get(stage, []))]

    def _proven(self, record, subkey) -> bool:
        return True


async def test_a_record_under_another_stages_key_is_not_listed():
    directory = Directory({1: [record("QmHonest", 1).dict(), record("QmFiledWrong", 0).dict()]})
    assert [r.peer_id for r in await directory.all_records(1)] == ["QmHonest"]
    assert await directory.all_records(0) == []


def test_a_version_is_at_most_64_characters():
    StageRecord.parse_obj(record("Qm", 0).dict() | {"version": "9" * 64})
    with pytest.raises(pydantic.ValidationError):
        StageRecord.parse_obj(record("Qm", 0).dict() | {"version": "9" * 5000})


@pytest.mark.parametrize("updated_at", [1e18, float("inf"), float("nan"), -1.0])
def test_an_update_time_far_ahead_of_this_clock_or_not_a_time_is_refused(updated_at):
    with pytest.raises(pydantic.ValidationError, match="updated_at"):
        StageRecord.parse_obj(record("Qm", 0).dict() | {"updated_at": updated_at})


def test_an_update_time_a_little_ahead_of_this_clock_is_kept():
    # Honest clocks differ by seconds; a record a minute ahead is still a live replica.
    StageRecord.parse_obj(record("Qm", 0).dict() | {"updated_at": time.time() + 60.0})
