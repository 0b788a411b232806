"""The first hour of a volunteer and an operator, as the docs tell it, in real processes on
127.0.0.1: the documented `join` (taken from README.md and docs/volunteer.md, not copied here)
trains with no other flag, its first stage-0 node waits for a stage-1 replica instead of dying, a
swarm outlives the restart of its only bootstrap and the loss of one of two, and Ctrl-C or SIGTERM
to a process group (as a terminal and systemd send them) ends `join` and `bootstrap` within their
drain time, with no traceback.

Each process runs in a process group of its own (ProcessGroup: signalled as a terminal would, and
always drained at teardown, grandchildren such as p2pd included)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco_node.experiments.process_group import ProcessGroup
from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 3.0
STARTUP_S = 5.0


class Proc:
    """One command in a process group of its own, its output in a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.group, self.log = ProcessGroup(), log
        with open(log, "w") as out:
            self.proc = self.group.spawn(argv, stdout=out, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop_like_a_terminal(self, sig: int, within_s: float) -> float:
        """Signal the whole group (the daemon too, as Ctrl-C or systemd does); seconds to exit."""
        start = time.monotonic()
        self.group.signal(sig)
        try:
            self.proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running {within_s:.0f} s after {signal.Signals(sig).name} to its group:\n{self.text()[-3000:]}"
            )
        return time.monotonic() - start


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.group.drain(grace_s=5.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tmp_path: Path, **extra) -> Path:
    """The test's stand-in for a swarm's run.toml: the tiny model, fast heartbeats."""
    values = dict(
        v.split("=", 1)
        for v in tiny_overrides(
            tmp_path,
            **{
                "outer.method": "noloco",
                "outer.inner_steps_per_outer": 1000,
                "inner.total_steps": 100000,
                "timeouts.startup_s": STARTUP_S,
                "timeouts.drain_s": DRAIN_S,
                "timeouts.match_s": 2.0,
                **extra,
            },
        )
    )
    prepare_tokenizer([f"{k}={v}" for k, v in values.items()])
    sections: dict[str, dict[str, str]] = {}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    lines = []
    for section, fields in sections.items():
        lines.append(f"[{section}]")
        for name, value in fields.items():
            lines.append(f"{name} = {value if _is_number(value) else json.dumps(value)}")
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _is_number(value: str) -> bool:
    return re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", value) is not None


def documented(command: str) -> list[str]:
    """The `noloco-node COMMAND --initial-peers MADDR ...` line a newcomer copies: README.md's, which
    docs/volunteer.md must repeat word for word."""
    found = []
    for page in (ROOT / "README.md", ROOT / "docs" / "volunteer.md"):
        lines = [
            line.split("#")[0].strip()
            for line in page.read_text().splitlines()
            if re.match(rf"^\.venv/bin/noloco-node {command} --initial-peers MADDR", line.strip())
        ]
        assert lines, f"{page.name} lost its {command} command"
        found.append(lines[0])
    assert found[0] == found[1], f"README.md and volunteer.md document different {command} lines: {found}"
    return shlex.split(found[0])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "noloco_node", *args]


def as_run(doc_argv: list[str], maddrs: list[str], *extra: str) -> list[str]:
    """The documented command with MADDR filled in, plus the test's config (the tiny model) and a
    ready file to watch it by."""
    assert doc_argv[0] == ".venv/bin/noloco-node"
    argv = []
    for arg in doc_argv[1:]:
        argv += maddrs if arg == "MADDR" else [arg]
    return cli(*argv, *extra)


def start_bootstrap(procs: list, tmp_path: Path, name: str, port: int, *extra: str) -> str:
    maddr_file = tmp_path / f"{name}.maddr"
    maddr_file.unlink(missing_ok=True)
    p = Proc(
        cli(
            "bootstrap",
            "--port",
            str(port),
            "--identity",
            str(tmp_path / f"{name}.key"),
            "--maddr-file",
            str(maddr_file),
            "--set",
            "timeouts.heartbeat_s=1.0",
            *extra,
        ),
        tmp_path / f"{name}.log",
    )
    procs.append(p)
    wait_for(lambda: maddr_file.exists(), 30, f"{name} did not start", p)
    return maddr_file.read_text().split()[0]


def start_join(procs: list, tmp_path: Path, name: str, argv: list[str]) -> tuple[Proc, Path]:
    ready = tmp_path / f"{name}.ready.json"
    p = Proc([*argv, "--ready-file", str(ready), "--threads", "1"], tmp_path / f"{name}.log")
    procs.append(p)
    return p, ready


def ready(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate, timeout_s: float, what: str, *watched: Proc) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in watched:
            if not p.alive():
                pytest.fail(f"{what}: a process exited with {p.proc.returncode}:\n{p.text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.log.name}\n{p.text()[-2000:]}" for p in watched)
            pytest.fail(f"{what} within {timeout_s:.0f} s\n{logs}")
        time.sleep(0.2)


def status(config: Path, maddr: str) -> list[dict]:
    out = subprocess.run(
        cli("status", "--config", str(config), "--initial-peers", maddr, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["replicas"]


def status_lists_every_replica(config: Path, maddr: str, ready_files: list[Path], within_s: float = 30) -> None:
    """`noloco-node status` through `maddr` lists exactly these nodes, within `within_s`."""
    peers = {ready(p)["peer_id"] for p in ready_files}
    deadline = time.monotonic() + within_s
    while True:
        listed = status(config, maddr)
        if {r["peer_id"] for r in listed} == peers:
            return
        assert time.monotonic() < deadline, f"status through {maddr} lists {listed}, not {peers}"
        time.sleep(1)


def assert_clean(p: Proc) -> None:
    text = p.text()
    assert "Traceback" not in text and "never retrieved" not in text, text[-4000:]


def test_the_documented_join_trains_a_first_stage_0_waits_and_group_signals_stop_cleanly(tmp_path, procs):
    config = tiny_config(tmp_path)
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", free_port())
    # The preflight the docs put first passes against a fresh swarm.
    doctor = subprocess.run(
        as_run(documented("doctor"), [maddr], "--config", str(config)), capture_output=True, text=True, timeout=120
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr[-2000:]
    # With no node up yet, the bootstrap itself dials our address (it answers probes over libp2p).
    assert "[ok  ] reach" in doctor.stdout and "[ok  ] clock" in doctor.stdout, doctor.stdout
    doc = documented("join")
    first, first_ready = start_join(procs, tmp_path, "first", as_run(doc, [maddr], "--config", str(config)))
    # Alone in the swarm, `auto` gives it stage 0; it waits for a stage-1 replica, saying so, well
    # past timeouts.startup_s (the old behaviour: TimeoutError and exit 1 after it).
    wait_for(
        lambda: ready(first_ready).get("waiting_for") == "a stage-1 replica",
        60,
        "the first node never said it waits for a stage-1 replica",
        first,
    )
    assert ready(first_ready)["stage"] == 0
    time.sleep(STARTUP_S + 3)
    assert first.alive() and ready(first_ready)["inner_step"] == 0

    second, second_ready = start_join(procs, tmp_path, "second", as_run(doc, [maddr], "--config", str(config)))
    wait_for(lambda: ready(second_ready).get("stage") == 1, 60, "the second node did not take stage 1", first, second)
    wait_for(
        lambda: ready(first_ready).get("inner_step", 0) >= 3 and ready(second_ready).get("served", 0) >= 6,
        90,
        "the documented join did not train (stage-0 steps and stage-1 microbatches)",
        first,
        second,
    )
    assert ready(first_ready)["waiting_for"] is None
    # The container healthcheck's command asks the node's own gRPC health service.
    health = subprocess.run(
        cli("health", "--address", ready(first_ready)["address"]), capture_output=True, text=True, timeout=60
    )
    assert health.returncode == 0 and health.stdout.startswith("serving"), health.stdout + health.stderr

    # Ctrl-C in the terminal of each (SIGINT to its process group), SIGTERM as systemd sends it.
    bound = DRAIN_S + 5 + 5  # drain + the 5 s, + a loaded CI machine's process exit
    first_s = first.stop_like_a_terminal(signal.SIGINT, bound)
    second_s = second.stop_like_a_terminal(signal.SIGTERM, bound)
    boot_s = procs[0].stop_like_a_terminal(signal.SIGINT, 10)
    print(f"stopped in: join SIGINT {first_s:.1f} s, join SIGTERM {second_s:.1f} s, bootstrap SIGINT {boot_s:.1f} s")
    assert first.proc.returncode == 0 and second.proc.returncode == 0 and procs[0].proc.returncode == 0
    for p in (first, second, procs[0]):
        assert_clean(p)
    assert "summary: stage 0" in first.text()
    gone = subprocess.run(
        cli("health", "--address", ready(first_ready)["address"]), capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 1 and gone.stderr.startswith("not serving"), gone.stdout + gone.stderr


def test_a_restarted_bootstrap_rejoins_the_swarm_it_lost(tmp_path, procs):
    config = tiny_config(tmp_path)
    port = free_port()
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", port)
    s1, s1_ready = start_join(
        procs, tmp_path, "s1", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "1")
    )
    s0, s0_ready = start_join(
        procs, tmp_path, "s0", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "0")
    )
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 3, 90, "the swarm did not train", s0, s1)

    procs[0].group.signal(signal.SIGKILL)  # the only bootstrap dies
    procs[0].proc.wait(timeout=10)
    step = ready(s0_ready)["inner_step"]
    wait_for(lambda: ready(s0_ready)["inner_step"] >= step + 3, 60, "training stopped with the bootstrap", s0, s1)

    again = start_bootstrap(procs, tmp_path, "bootstrap", port)  # same identity, same port
    assert again == maddr
    new, new_ready = start_join(
        procs, tmp_path, "s1-new", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "1")
    )
    wait_for(
        lambda: ready(new_ready).get("served", 0) >= 2,
        60,
        "a replica that joined through the restarted bootstrap received no microbatch",
        s0,
        s1,
        new,
    )
    status_lists_every_replica(config, maddr, [s0_ready, s1_ready, new_ready])


def test_a_swarm_with_two_bootstraps_outlives_one(tmp_path, procs):
    config = tiny_config(tmp_path)
    a = start_bootstrap(procs, tmp_path, "bootstrap-a", free_port())
    b = start_bootstrap(procs, tmp_path, "bootstrap-b", free_port(), "--initial-peers", a)
    both = ["--initial-peers", a, b]
    s1, s1_ready = start_join(procs, tmp_path, "s1", cli("join", "--config", str(config), *both, "--stage", "1"))
    s0, s0_ready = start_join(procs, tmp_path, "s0", cli("join", "--config", str(config), *both, "--stage", "0"))
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 2, 90, "the swarm did not train", s0, s1)

    procs[0].stop_like_a_terminal(signal.SIGTERM, 10)  # bootstrap a, for good
    assert_clean(procs[0])
    new, new_ready = start_join(procs, tmp_path, "s1-new", cli("join", "--config", str(config), *both, "--stage", "1"))
    wait_for(
        lambda: ready(new_ready).get("served", 0) >= 2,
        60,
        "a joiner given both bootstraps, one of them gone, received no microbatch",
        s0,
        s1,
        new,
    )
    status_lists_every_replica(config, b, [s0_ready, s1_ready, new_ready])
