"""The bridge's private folders of unix sockets (/tmp/noloco-bridge-*). A process that ends
normally removes its own; one killed with SIGKILL (the OOM killer, `kill -9`, a test's chaos)
cannot, and its folder stays in /tmp for good: an audit counted 445 on one machine. Each folder
names the process that made it (owner.pid: its pid and start time), so a node starting removes the
folders of this user's processes that are gone, and never one a live process may still use."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "noloco-bridge-"
OWNER = "owner.pid"


def make_bridge_dir() -> tempfile.TemporaryDirectory:
    """A private folder (0700: only this user's processes may speak as us through it) that says
    which process it belongs to; the sweep of the folders the dead left runs first."""
    remove_dead_bridge_dirs(Path(tempfile.gettempdir()))
    folder = tempfile.TemporaryDirectory(prefix=PREFIX)
    os.chmod(folder.name, 0o700)
    (Path(folder.name) / OWNER).write_text(_process_tag(os.getpid()) or "")
    return folder


def remove_dead_bridge_dirs(directory: Path) -> int:
    """Remove this user's bridge folders in `directory` whose owner process is gone (its pid is
    free, or now another process's); folders that name no owner are left alone. Never raises."""
    removed, uid = 0, os.getuid()
    for folder in directory.glob(PREFIX + "*"):
        try:
            if folder.lstat().st_uid != uid or not folder.is_dir():
                continue
            tag = (folder / OWNER).read_text().strip()
        except OSError:
            continue
        pid = tag.split(":", 1)[0]
        if tag and pid.isdigit() and _process_tag(int(pid)) != tag:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if removed:
        log.debug("removed %d bridge folder(s) of processes that are gone from %s", removed, directory)
    return removed


def _process_tag(pid: int) -> str | None:
    """`pid:start time` (in clock ticks since boot, /proc/PID/stat field 22): a pid the kernel
    gives to another process later gets another tag. None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rpartition(')')[2].split()[19]}"
