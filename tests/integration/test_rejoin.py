"""A volunteer who stops and runs the documented `join` again comes back with the newest state there
is: the only replica of a stage keeps its weights in its default checkpoint folder (no flag) and
takes the stage up again from it; a checkpoint that live replicas have since passed is left for
their state. Real processes on 127.0.0.1, the documented command lines, one state home per test."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from .volunteer_procs import as_run, assert_clean, documented, free_port, ready, start_bootstrap, start_join, wait_for
from .volunteer_procs import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_the_documented_join_comes_back_with_the_newest_state(tmp_path, procs):
    # behind_rounds = 0: any later live step makes a checkpoint stale (the default lets a checkpoint
    # lag two outer rounds, which with this config's H of 1000 would keep every one of them).
    config = tiny_config(tmp_path, **{"checkpoint.behind_rounds": 0})
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", free_port())
    doc = as_run(documented("join"), [maddr], "--config", str(config))
    s0, s0_ready = start_join(procs, tmp_path, "s0", doc)
    wait_for(lambda: ready(s0_ready).get("stage") == 0, 60, "the first node did not take stage 0", s0)
    s1, s1_ready = start_join(procs, tmp_path, "s1", doc)
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 3, 90, "the swarm did not train", s0, s1)
    assert ready(s1_ready)["stage"] == 1

    # Ctrl-C on the only stage-1 node: its weights stay in its default folder, and it says where.
    s1.stop_like_a_terminal(signal.SIGINT, 15)
    assert s1.proc.returncode == 0
    assert_clean(s1)
    home = Path(os.environ["XDG_STATE_HOME"]) / "noloco-node"
    kept = re.search(r"stay in the checkpoint in (\S+);", s1.text())
    assert kept, s1.text()[-3000:]
    folder = Path(kept.group(1))
    assert folder.parent.parent.parent == home and (folder / "stage1.json").is_file(), folder
    saved_step = int(re.findall(r"checkpoint at inner step (\d+)", s1.text())[-1])

    # The same command again: it takes the stage back from that folder, at the step it left.
    back, back_ready = start_join(procs, tmp_path, "s1-back", doc)
    wait_for(lambda: ready(back_ready).get("served", 0) >= 2, 90, "the returning node served nothing", s0, back)
    assert ready(back_ready)["stage"] == 1
    assert f"resuming stage 1 from the checkpoint in {folder}" in back.text(), back.text()[-3000:]
    assert f"resumed from checkpoint at inner step {saved_step}" in back.text(), back.text()[-3000:]

    # A second stage-1 replica joins (a folder of its own, no checkpoint: it copies the live
    # state); the returning node leaves again and the new one trains on past its checkpoint.
    other, other_ready = start_join(procs, tmp_path, "s1-other", [*doc, "--stage", "1"])
    wait_for(lambda: ready(other_ready).get("served", 0) >= 2, 90, "the second stage-1 replica served nothing", s0)
    assert "with state from" in other.text() and "resumed from checkpoint" not in other.text(), other.text()[-3000:]
    back.stop_like_a_terminal(signal.SIGINT, 15)
    left_at = int(re.findall(r"checkpoint at inner step (\d+)", back.text())[-1])
    wait_for(
        lambda: ready(other_ready).get("inner_step", 0) >= left_at + 2,
        90,
        "the remaining stage-1 replica did not train on",
        s0,
        other,
    )

    # The documented join once more: the folder it gets holds that stale checkpoint of stage 1,
    # which the live replica has passed: the newcomer takes the live state, not the checkpoint.
    again, again_ready = start_join(procs, tmp_path, "s1-again", doc)
    wait_for(
        lambda: ready(again_ready).get("served", 0) + ready(again_ready).get("inner_step", 0) >= 2,
        90,
        "the node that came back a second time did not train",
        s0,
        other,
        again,
    )
    text = again.text()
    assert f"in {folder} (inner step {left_at}) is more than 0 inner steps behind its live replicas" in text, text[
        -3000:
    ]
    assert "resumed from checkpoint" not in text, text[-3000:]
    for p in (s0, other, again):
        assert_clean(p)
