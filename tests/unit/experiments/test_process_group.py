"""ProcessGroup and raise_on_signals with real (tiny) processes: one group outside the launcher's,
killpg ends it, children die with a SIGKILLed launcher, a spawn from a short-lived thread is not
tied to that thread, and a stop signal becomes one Interrupted."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from noloco_node.experiments.process_group import Interrupted, ProcessGroup, raise_on_signals

pytestmark = pytest.mark.timeout(60)


def alive(pid: int) -> bool:
    """Running or stopped; a zombie counts as gone (an orphan's reaper may be slow or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_one_group_outside_the_launchers_and_drain_ends_all_of_it():
    group = ProcessGroup()
    try:
        first, second = group.spawn(["sleep", "60"]), group.spawn(["sleep", "60"])
        assert os.getpgid(first.pid) == os.getpgid(second.pid) == group.pgid == first.pid
        # Outside the launcher's group, so a terminal's Ctrl-C reaches the launcher alone.
        assert group.pgid != os.getpgrp()
        assert sorted(group.members()) == sorted([first.pid, second.pid])
        start = time.monotonic()
        group.drain(grace_s=10)
        assert time.monotonic() - start < 5  # sleep ends on SIGTERM: no wait for the grace period
        assert [first.returncode, second.returncode] == [-signal.SIGTERM, -signal.SIGTERM]
        assert group.members() == []
    finally:
        kill_all([p.pid for p in group.procs])


def test_a_child_started_after_the_group_emptied_leads_a_new_one():
    group = ProcessGroup()
    try:
        group.spawn(["true"]).wait(timeout=10)
        later = group.spawn(["sleep", "60"])
        assert group.pgid == later.pid == os.getpgid(later.pid)
        group.drain(grace_s=10)
        assert later.returncode == -signal.SIGTERM
    finally:
        kill_all([p.pid for p in group.procs])


def test_a_child_spawned_from_a_thread_outlives_that_thread_with_stop_signals_unblocked():
    group, spawned = ProcessGroup(), []
    try:
        thread = threading.Thread(target=lambda: spawned.append(group.spawn(["sleep", "60"])))
        thread.start()
        thread.join(timeout=20)
        assert spawned, "spawn from a thread did not return"
        # PDEATHSIG follows the forking thread: forked by the thread itself, sleep would get
        # SIGTERM as soon as the thread ended.
        with pytest.raises(subprocess.TimeoutExpired):
            spawned[0].wait(timeout=1.0)
        blocked = next(
            line
            for line in Path(f"/proc/{spawned[0].pid}/status").read_text().splitlines()
            if line.startswith("SigBlk:")
        )
        assert int(blocked.split()[1], 16) == 0, blocked
        group.drain(grace_s=10)
        assert spawned[0].returncode == -signal.SIGTERM
    finally:
        kill_all([p.pid for p in group.procs])


def test_children_die_with_a_sigkilled_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from noloco_node.experiments.process_group import ProcessGroup
        group = ProcessGroup()
        procs = [group.spawn(["sleep", "60"]) for _ in range(2)]
        print(" ".join(str(p.pid) for p in procs), flush=True)
        time.sleep(60)
    """)
    )
    launcher = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        launcher.kill()  # no handler can run: only the death signal can end the children
        launcher.wait(timeout=10)
        assert wait_gone(pids, 10) == []
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        launcher.stdout.close()
        kill_all(pids)


def test_the_first_stop_signal_raises_once_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    unwound = False
    with pytest.raises(Interrupted) as info:
        with raise_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 5  # the handler runs between bytecodes, almost at once
                while time.monotonic() < deadline:
                    pass
            finally:
                # A second SIGTERM while unwinding (the swarm draining) must not raise again.
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100_000):
                    pass
                unwound = True
    assert info.value.signum == signal.SIGTERM and info.value.exit_code == 143
    assert isinstance(info.value, KeyboardInterrupt) and not isinstance(info.value, Exception)
    assert unwound
    assert signal.getsignal(signal.SIGTERM) is before
