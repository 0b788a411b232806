"""Bridge folders a killed process left in /tmp go at the next start; a live process's folder, and
one that names no owner, stay (an audit counted 445 left behind on one machine)."""

import os
import subprocess
import sys

from noloco_node.transport.bridge_dirs import OWNER, PREFIX, _process_tag, make_bridge_dir, remove_dead_bridge_dirs


def _folder(root, name: str, tag: str | None):
    folder = root / f"{PREFIX}{name}"
    folder.mkdir()
    (folder / "0.sock").write_text("")
    if tag is not None:
        (folder / OWNER).write_text(tag)
    return folder


def test_only_the_folders_of_processes_that_are_gone_are_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead_tag = _process_tag(child.pid)
    child.kill()
    child.wait()
    ours = _process_tag(os.getpid())
    dead = _folder(tmp_path, "dead", dead_tag)
    reused = _folder(tmp_path, "reused", f"{os.getpid()}:1")  # our pid, another process's start time
    alive = _folder(tmp_path, "alive", ours)
    unnamed = _folder(tmp_path, "legacy", None)
    assert remove_dead_bridge_dirs(tmp_path) == 2
    assert not dead.exists() and not reused.exists() and alive.exists() and unnamed.exists()
    assert remove_dead_bridge_dirs(tmp_path / "absent") == 0


def test_a_new_bridge_folder_is_private_and_names_this_process():
    folder = make_bridge_dir()
    try:
        assert os.stat(folder.name).st_mode & 0o777 == 0o700
        with open(os.path.join(folder.name, OWNER)) as f:
            assert f.read() == _process_tag(os.getpid())
    finally:
        folder.cleanup()
