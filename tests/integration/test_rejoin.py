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

from .volunteer_procs import as_run, assert_clean, documented, free_port, ready, start_bootstrap, start_join, status
from .volunteer_procs import tiny_config, wait_for

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
    # The newcomer judges by the swarm's records, which lag a node's own file by a heartbeat or more
    # on a loaded box (CI once saw the newcomer resume the checkpoint): wait for the record too.
    other_id = ready(other_ready)["peer_id"]
    wait_for(
        lambda: any(r["peer_id"] == other_id and r["inner_step"] > left_at for r in status(config, maddr)),
        60,
        "the swarm's record of the remaining stage-1 replica never passed the checkpoint",
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


def test_a_returning_node_takes_the_folder_of_the_stage_nobody_serves(tmp_path, procs):
    """Two nodes of one machine stop, the stage-1 one first; the first to come back takes the folder
    holding stage 1's only weights, not the lowest free folder (the other's stage 0, which a third
    node still serves). A newcomer's audit saw the lowest folder taken and stage 1 begun afresh."""
    config = tiny_config(tmp_path)
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", free_port())
    doc = as_run(documented("join"), [maddr], "--config", str(config))
    first, first_ready = start_join(procs, tmp_path, "first", doc)
    wait_for(lambda: ready(first_ready).get("stage") == 0, 60, "the first node did not take stage 0", first)
    second, second_ready = start_join(procs, tmp_path, "second", doc)
    third, third_ready = start_join(procs, tmp_path, "third", [*doc, "--stage", "0"])
    wait_for(lambda: ready(third_ready).get("inner_step", 0) >= 2, 90, "the swarm did not train", first, second, third)
    assert ready(second_ready)["stage"] == 1

    second.stop_like_a_terminal(signal.SIGINT, 15)
    first.stop_like_a_terminal(signal.SIGINT, 15)
    stage1_folder = Path(re.search(r"stay in the checkpoint in (\S+);", second.text()).group(1))
    stage0_folder = Path(re.search(r"in (\S+) \(--set checkpoint.dir", first.text()).group(1))
    assert stage0_folder.name < stage1_folder.name, (stage0_folder, stage1_folder)  # the lowest is stage 0's
    saved_step = int(re.findall(r"checkpoint at inner step (\d+)", second.text())[-1])

    back, back_ready = start_join(procs, tmp_path, "back", doc)
    wait_for(lambda: ready(back_ready).get("served", 0) >= 2, 90, "the returning node served nothing", third, back)
    assert ready(back_ready)["stage"] == 1
    assert f"resuming stage 1 from the checkpoint in {stage1_folder}" in back.text(), back.text()[-3000:]
    assert f"resumed from checkpoint at inner step {saved_step}" in back.text(), back.text()[-3000:]
