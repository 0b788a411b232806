"""runtime/memory.rss_mb samples a process that may end at any moment: a process gone between the
open of /proc/PID/status and its read (ProcessLookupError, a CI failure) reads as exited, None."""

import os
import subprocess
import sys

import pytest

from noloco_node.runtime import memory


def test_a_live_process_has_a_resident_size_and_a_reaped_one_has_none():
    assert memory.rss_mb(os.getpid()) > 1
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert memory.rss_mb(child.pid) is None


def test_a_process_that_goes_while_its_status_is_read_reads_as_exited(monkeypatch):
    class Vanishing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(memory, "open", lambda *a, **k: Vanishing(), raising=False)
    assert memory.rss_mb(12345) is None


def test_other_errors_still_surface(monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(memory, "open", refuse, raising=False)
    with pytest.raises(PermissionError):
        memory.rss_mb(12345)
