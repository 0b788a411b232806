"""Killing `noloco-node demo` mid-run ends its whole swarm (issue 14, item 3): SIGTERM makes the
demo drain its nodes and exit 143; SIGKILL, which no handler sees, still takes every process of
the swarm down (each child has PR_SET_PDEATHSIG). Real processes on 127.0.0.1."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

# LocalSwarm.stop's worst case: nodes' grace (45 s) + the bootstrap's (15 s) + the group sweep's
# (5 s, then up to 10 s after SIGKILL).
DRAIN_TIMEOUT_S = 45 + 15 + 5 + 10


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp), or None once the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
    return state, int(ppid), int(pgrp)


def alive(pid: int) -> bool:
    """A zombie counts as gone: an orphan's reaper (PID 1 in a container) may be slow or absent."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (the demo's --out folder)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.isdigit() and text in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_demo_mid_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    sets = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 5,
            "timeouts.match_s": 3.0,
            "timeouts.drain_s": 3.0,
        },
    )
    out = tmp_path / "demo"
    # Far more steps than the test lets it run: it is always killed mid-run.
    cmd = [
        sys.executable,
        "-m",
        "noloco_node",
        "demo",
        "--replicas",
        "1",
        "--stages",
        "2",
        "--steps",
        "5000",
        "--timeout",
        "600",
        "--out",
        str(out),
        *[a for s in sets for a in ("--set", s)],
    ]
    with open(tmp_path / "demo.log", "w") as log:
        # Its own session, like a service: the test's signals go to the demo alone.
        demo = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return demo, out


def wait_training(demo: subprocess.Popen, out: Path, tmp_path: Path, timeout_s: float = 240) -> None:
    """Until both nodes are ready and stage 0 has taken an inner step."""
    deadline = time.monotonic() + timeout_s
    ready = [out / "ready" / f"stage{s}-r0.json" for s in (0, 1)]
    while True:
        assert demo.poll() is None, (
            f"demo exited early with {demo.returncode}:\n" + (tmp_path / "demo.log").read_text()[-3000:]
        )
        try:
            steps = [json.loads(p.read_text()).get("inner_step", 0) for p in ready]
        except (OSError, ValueError):
            steps = None
        if steps is not None and steps[0] >= 1:
            return
        assert time.monotonic() < deadline, (
            f"swarm not training after {timeout_s} s:\n" + (tmp_path / "demo.log").read_text()[-3000:]
        )
        time.sleep(0.2)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def swarm_pids(demo: subprocess.Popen) -> list[int]:
    pids = descendants(demo.pid)
    # The bootstrap and the 2 nodes (forked from the demo's zygote, or exec'd where it could not
    # start), in one process group of their own: neither the demo's nor the zygote's.
    swarm = [p for p in pids if re.search(r"noloco[-_]node (join|bootstrap) ", cmdline(p))]
    groups = {proc_stat(p)[2] for p in swarm}
    assert len(swarm) == 3, f"expected bootstrap + 2 nodes under the demo, found {[cmdline(p)[:80] for p in pids]}"
    assert len(groups) == 1 and os.getpgid(demo.pid) not in groups, (groups, os.getpgid(demo.pid))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_demo_mid_run_leaves_no_process_of_its_swarm(tmp_path, sig):
    demo, out = start_demo_mid_run(tmp_path)
    pids: list[int] = []
    try:
        wait_training(demo, out, tmp_path)
        pids = swarm_pids(demo)
        killed = time.monotonic()
        demo.send_signal(sig)
        demo.wait(timeout=DRAIN_TIMEOUT_S)
        left = pids
        while (
            left := [p for p in left if alive(p)] + [p for p in mentioning(str(out)) if p not in left]
        ) and time.monotonic() - killed < DRAIN_TIMEOUT_S:
            time.sleep(0.2)
        elapsed = time.monotonic() - killed
        print(f"{sig.name}: demo exited {demo.returncode}, swarm of {len(pids)} processes gone after {elapsed:.1f} s")
        assert left == [], f"still running {elapsed:.0f} s after {sig.name}: " + ", ".join(
            cmdline(p)[:200] for p in left if alive(p)
        )
        log = (tmp_path / "demo.log").read_text()
        if sig == signal.SIGTERM:
            # It drained the swarm itself (it did not die of the signal) and said why it stopped.
            assert demo.returncode == 128 + signal.SIGTERM, log[-3000:]
            assert "stopped by SIGTERM" in log and "Traceback" not in log, log[-3000:]
        else:
            assert demo.returncode == -signal.SIGKILL
    finally:
        demo.kill()
        demo.wait(timeout=10)
        kill_all(pids + mentioning(str(out)))


def test_a_swarm_started_again_in_the_same_folder_joins_its_own_bootstrap(tmp_path):
    """The demo run twice in one folder: the bootstrap's address file of the first run named its
    port, and the second run's nodes read it before the new bootstrap wrote its own."""
    from noloco_node.experiments.launcher import LocalSwarm

    stale = "/ip4/127.0.0.1/tcp/9/p2p/QmStaleBootstrapOfTheRunBeforeThisOne"
    (tmp_path / "bootstrap.maddr").write_text(stale + "\n")
    with LocalSwarm(tmp_path, overrides=tiny_overrides(tmp_path), startup_timeout_s=60) as swarm:
        maddr = swarm.start_bootstrap()
        assert maddr != stale and maddr.startswith("/ip4/127.0.0.1/tcp/")
        assert (tmp_path / "bootstrap.maddr").read_text().split()[0] == maddr
