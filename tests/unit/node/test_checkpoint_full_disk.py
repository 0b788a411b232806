"""A checkpoint that cannot be written (a volunteer's disk filled up) is a warning, not the end of
the training: the boundary logs it and returns, and the previous checkpoint stays."""

import errno
import logging
from pathlib import Path
from types import SimpleNamespace

from noloco_node.node.boundary import InnerStepBoundary
from noloco_node.runtime.events import EventLog


class _FullDisk:
    directory = Path("/state/noloco-node/run/node-0")

    async def save(self, stage_index: int, microbatches=None) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")


def _boundary(checkpoints, events: EventLog) -> InnerStepBoundary:
    worker = SimpleNamespace(inner_steps=150)
    return InnerStepBoundary(
        worker=worker,
        sync=None,
        events=events,
        compute=None,
        stage_index=1,
        bytes_sent=lambda: 0,
        checkpoints=checkpoints,
    )


async def test_a_full_disk_is_a_warning_and_training_goes_on(caplog, tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    with caplog.at_level(logging.WARNING):
        await _boundary(_FullDisk(), events).checkpoint(None)
    assert "could not write the checkpoint of inner step 150 in /state/noloco-node/run/node-0" in caplog.text
    assert "No space left on device" in caplog.text and "training goes on" in caplog.text
    events.close()
    assert '"checkpoint"' not in (tmp_path / "events.jsonl").read_text()  # no event for a file that is not there
