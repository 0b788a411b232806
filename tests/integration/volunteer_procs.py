"""Volunteers' and operators' commands as real processes on 127.0.0.1, for the first-hour tests:
each command in a process group of its own (signalled as a terminal would, always drained at
teardown, grandchildren such as p2pd included), the documented command lines taken from README.md
and docs/volunteer.md, and a tiny run.toml standing in for a swarm's."""

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
