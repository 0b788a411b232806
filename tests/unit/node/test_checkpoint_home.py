"""`join`'s default checkpoint folder: one slot per running node under the user's state home, the
same slot again for the next node once the last one stopped (or died), and the config it yields."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco_node.cli.join import _with_checkpoint_home
from noloco_node.config import ConfigError, build_config
from noloco_node.node.checkpoint_home import CheckpointSlot, config_fingerprint, run_directory, state_home


def test_the_state_home_follows_xdg_and_a_run_id_becomes_a_safe_folder_name(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert state_home() == tmp_path / "noloco-node"
    assert run_directory("my run/../x", "f1") == tmp_path / "noloco-node" / "my_run_.._x" / "f1"
    assert run_directory("..", "f1").parent.name == "_"


def test_nodes_running_at_once_get_folders_of_their_own_and_a_freed_one_is_taken_again(tmp_path):
    first = CheckpointSlot.claim("run", "fp", home=tmp_path)
    second = CheckpointSlot.claim("run", "fp", home=tmp_path)
    assert (first.directory.name, second.directory.name) == ("node-0", "node-1")
    first.release()
    with CheckpointSlot.claim("run", "fp", home=tmp_path) as again:
        assert again.directory == first.directory
    second.release()
    with CheckpointSlot.claim("other-run", "fp", home=tmp_path) as other:
        assert other.directory == tmp_path / "other-run" / "fp" / "node-0"


def test_a_slot_held_by_another_process_is_skipped_until_that_process_dies(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from noloco_node.node.checkpoint_home import CheckpointSlot;"
            f"s = CheckpointSlot.claim('run', 'fp', home=Path({str(tmp_path)!r})); print(s.directory, flush=True);"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip().endswith("node-0")
        with CheckpointSlot.claim("run", "fp", home=tmp_path) as mine:
            assert mine.directory.name == "node-1"
    finally:
        holder.kill()  # no release: the kernel drops the lock with the process
        holder.wait(timeout=10)
    deadline = time.monotonic() + 5
    while True:
        with CheckpointSlot.claim("run", "fp", home=tmp_path) as slot:
            if slot.directory.name == "node-0":
                break
        assert time.monotonic() < deadline, slot.directory


def test_no_slot_to_be_had_names_the_field_and_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as bad:
        CheckpointSlot.claim("run", "fp", home=blocker)
    assert "checkpoint.dir" in str(bad.value) and "checkpoint.auto = false" in str(bad.value)
    held = [CheckpointSlot.claim("run", "fp", home=tmp_path, slots=2) for _ in range(2)]
    with pytest.raises(ConfigError, match="all 2 default checkpoint folders .* are held by running nodes"):
        CheckpointSlot.claim("run", "fp", home=tmp_path, slots=2)
    for slot in held:
        slot.release()


def test_join_keeps_checkpoints_by_default_holds_a_named_folder_and_leaves_auto_false_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config, slot = _with_checkpoint_home(build_config({"run": {"run_id": "r1"}}))
    try:
        fingerprint = config_fingerprint(build_config({"run": {"run_id": "r1"}}))
        assert config.checkpoint.dir == str(tmp_path / "noloco-node" / "r1" / fingerprint / "node-0")
    finally:
        slot.release()
    named = build_config({"checkpoint": {"dir": str(tmp_path / "mine")}})
    kept, held = _with_checkpoint_home(named)
    try:  # the folder is the config's own, held while the node runs
        assert kept == named and held.named and held.directory == tmp_path / "mine"
    finally:
        held.release()
    off = build_config({"checkpoint": {"auto": False}})
    assert _with_checkpoint_home(off) == (off, None) and off.checkpoint.dir is None


class _Stage:
    def __init__(self, steps: dict[str, int]) -> None:
        self.steps = steps

    async def replicas(self, stage: int, *, fresh: bool = False):
        from types import SimpleNamespace

        assert fresh, "a checkpoint is weighed against a fresh lookup"
        return [SimpleNamespace(peer_id=p, inner_step=s) for p, s in self.steps.items()]


async def test_a_checkpoint_is_behind_only_when_another_live_replica_is_further_on():
    from noloco_node.node.discovery import live_step_ahead

    assert await live_step_ahead(_Stage({"me": 90, "b": 40}), 1, 50, me="me") is None
    assert await live_step_ahead(_Stage({"b": 50}), 1, 50, me="me") is None
    assert await live_step_ahead(_Stage({}), 1, 50, me="me") is None
    assert await live_step_ahead(_Stage({"b": 51, "c": 70, "me": 99}), 1, 50, me="me") == 51  # what they agree on
    assert await live_step_ahead(_Stage({"b": 50, "c": 5000}), 1, 50, me="me") is None  # one claim far on
    assert await live_step_ahead(_Stage({"c": 70}), 1, 50, me="me", margin=20) is None  # lags by 20: kept
    assert await live_step_ahead(_Stage({"c": 71}), 1, 50, me="me", margin=20) == 71


def test_a_checkpoint_may_lag_two_outer_rounds_by_default():
    from noloco_node.node.discovery import checkpoint_margin

    assert checkpoint_margin(build_config({"outer": {"inner_steps_per_outer": 50}})) == 100
    assert checkpoint_margin(build_config({"checkpoint": {"behind_rounds": 0}})) == 0


def test_another_model_under_the_same_run_id_gets_another_folder():
    """A newcomer's `--set model.seq_len=64` under the default run id once took the folder of a run
    with 961 trained steps and wrote its own step 0 over them."""
    base = build_config({})
    assert config_fingerprint(base) == config_fingerprint(build_config({}))
    for other in ({"model": {"seq_len": 64}}, {"data": {"path": "other.txt"}}, {"outer": {"alpha": 0.6}}):
        assert config_fingerprint(build_config(other)) != config_fingerprint(base), other
    assert config_fingerprint(build_config({"checkpoint": {"every_steps": 7}})) == config_fingerprint(base)


def test_a_preferred_free_slot_is_claimed_before_the_lowest_and_a_held_one_is_passed_over(tmp_path):
    held = CheckpointSlot.claim("run", "fp", home=tmp_path)  # node-0, held by a running node
    for n in (1, 2, 3):
        (run_directory("run", "fp", tmp_path) / f"node-{n}").mkdir()
    assert [p.name for p in CheckpointSlot.free_slots("run", "fp", home=tmp_path)] == ["node-1", "node-2", "node-3"]
    node3 = run_directory("run", "fp", tmp_path) / "node-3"
    with CheckpointSlot.claim("run", "fp", home=tmp_path, prefer=[held.directory, node3]) as slot:
        assert slot.directory == node3  # node-0 is held: the next preferred one
        assert [p.name for p in CheckpointSlot.free_slots("run", "fp", home=tmp_path)] == ["node-1", "node-2"]
    elsewhere = tmp_path / "elsewhere" / "node-0"
    elsewhere.mkdir(parents=True)
    with CheckpointSlot.claim("run", "fp", home=tmp_path, prefer=[elsewhere]) as slot:
        assert slot.directory.name == "node-1"  # a folder of another run is never taken
    held.release()


def test_the_slots_of_stages_nobody_serves_come_first():
    from pathlib import Path

    from noloco_node.node.checkpoint_home import unserved_first

    slots = {Path("node-0"): [0], Path("node-1"): [1], Path("node-2"): [], Path("node-3"): [0, 1], Path("node-4"): [2]}
    assert unserved_first(slots, served={0}) == [Path("node-1"), Path("node-4")]
    assert unserved_first(slots, served={0, 1, 2}) == []


def test_a_pinned_stage_takes_its_own_checkpoint_and_never_another_stages_folder(tmp_path, monkeypatch):
    """Seen by a newcomer: `join --stage 1` took the lowest free folder, which held a stage-0
    checkpoint, and started at step 0 beside it; a later `--stage auto` resumed that stage 0."""
    import json

    import noloco_node.node.manifest as manifest

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(manifest, "load_run_inputs", lambda config: (None, None, "mh"))

    def pinned(stage: int):
        return build_config({"run": {"run_id": "r1"}, "pipeline": {"stage": stage, "num_stages": 3}})

    run_dir = run_directory("r1", config_fingerprint(pinned(0)), state_home())
    for n, stage, step in ((0, 0, 1394), (1, 1, 200), (2, 1, 2315)):
        (run_dir / f"node-{n}").mkdir(parents=True)
        meta = {"run_id": "r1", "manifest_hash": "mh", "stage": stage, "inner_step": step}
        (run_dir / f"node-{n}" / f"stage{stage}.json").write_text(json.dumps(meta))
    config, slot = _with_checkpoint_home(pinned(1))
    try:
        assert Path(config.checkpoint.dir).name == "node-2"  # stage 1's furthest trained
    finally:
        slot.release()
    config, slot = _with_checkpoint_home(pinned(2))
    try:
        assert Path(config.checkpoint.dir).name == "node-3"  # a folder of its own, not stage 0's node-0
    finally:
        slot.release()
    config, slot = _with_checkpoint_home(pinned(0))
    try:
        assert Path(config.checkpoint.dir).name == "node-0"
    finally:
        slot.release()


def test_a_named_checkpoint_folder_is_held_as_a_slot_is(tmp_path):
    """Two nodes given one checkpoint.dir overwrote and pruned each other's checkpoints (a
    newcomer's audit lost a stop checkpoint): the second is refused, naming the field."""
    from noloco_node.config import ConfigError
    from noloco_node.node.checkpoint_home import CheckpointSlot

    folder = tmp_path / "shared" / "ckpt"
    first = CheckpointSlot.hold(folder)
    assert first.named and folder.is_dir()
    with pytest.raises(ConfigError, match="checkpoint.dir.*held by another running node"):
        CheckpointSlot.hold(folder)
    first.release()
    CheckpointSlot.hold(folder).release()  # free again once the first node stopped
