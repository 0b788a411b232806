"""`doctor`'s disk check: where `join` will keep its checkpoints, that it can write there, and the
free space; a folder that cannot be written fails with the field and the fix (exit 17)."""

from noloco_node.cli.doctor import CODES, _disk_check
from noloco_node.config import build_config
from noloco_node.node.checkpoint_home import config_fingerprint


def test_the_default_folder_is_under_the_state_home_and_its_free_space_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    check = _disk_check(build_config({"run": {"run_id": "r1"}}))
    assert check.outcome == "ok", check
    folder = tmp_path / "noloco-node" / "r1" / config_fingerprint(build_config({"run": {"run_id": "r1"}}))
    assert check.detail.startswith(f"checkpoints go to {folder} (")
    assert check.detail.endswith(" GB free)") and not list(folder.iterdir())


def test_a_folder_that_cannot_be_written_fails_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    check = _disk_check(build_config({"checkpoint": {"dir": str(blocker / "ckpt")}}))
    assert check.outcome == "fail" and f"cannot write checkpoints in {blocker / 'ckpt'}" in check.detail
    assert "checkpoint.dir" in check.fix and CODES[check.name] == 17


def test_no_checkpoints_is_said_not_failed():
    check = _disk_check(build_config({"checkpoint": {"auto": False}}))
    assert check.outcome == "info" and "no checkpoints" in check.detail
