"""LocalSwarm: a bootstrap peer and D replicas x P stages as separate `noloco-node` processes on
127.0.0.1. Readiness comes from files the processes write, never from sleeps; stopping is SIGTERM,
then SIGKILL after a grace period, by pid, then a sweep of the swarm's process group (see
process_group.py: the swarm also dies with the launcher). Used by `noloco-node demo`, `experiment`,
the benchmarks and the integration tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.experiments.process_group import ProcessGroup


@dataclass
class NodeProcess:
    stage: int
    replica: int
    proc: subprocess.Popen
    ready_file: Path
    log_file: Path
    info: dict = field(default_factory=dict)
    extra: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"stage{self.stage}/replica{self.replica}"


class LocalSwarm:
    def __init__(
        self, out_dir: Path, *, overrides: list[str], threads: int = 1, startup_timeout_s: float = 60.0
    ) -> None:
        self.out_dir = Path(out_dir)
        self.overrides, self.threads, self.startup_timeout_s = overrides, threads, startup_timeout_s
        self.bootstrap: subprocess.Popen | None = None
        self.maddr: str | None = None
        self.nodes: list[NodeProcess] = []
        self.group = ProcessGroup()
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.out_dir / "ready").mkdir(parents=True, exist_ok=True)
        (self.out_dir / "nodes").mkdir(parents=True, exist_ok=True)

    def _env(self) -> dict:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS=str(self.threads),
            MKL_NUM_THREADS=str(self.threads),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        return env

    def _cmd(self, *args: str) -> list[str]:
        sets = [a for o in self.overrides for a in ("--set", o)]
        return [sys.executable, "-m", "noloco_node", *args[:1], *sets, *args[1:]]

    def start_bootstrap(self, *extra: str) -> str:
        maddr_file = self.out_dir / "bootstrap.maddr"
        # A file left by an earlier run in this folder names that run's port: wait for this one's.
        maddr_file.unlink(missing_ok=True)
        with open(self.out_dir / "logs" / "bootstrap.log", "w") as log:
            self.bootstrap = self.group.spawn(
                self._cmd(
                    "bootstrap",
                    "--port",
                    "0",
                    "--identity",
                    str(self.out_dir / "bootstrap.key"),
                    "--maddr-file",
                    str(maddr_file),
                    *extra,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while not maddr_file.exists():
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap peer did not start; see {self.out_dir / 'logs' / 'bootstrap.log'}")
            time.sleep(0.05)
        self.maddr = maddr_file.read_text().split()[0]
        return self.maddr

    def dashboard_url(self, timeout_s: float = 60.0) -> str:
        """The swarm page's address, as the bootstrap (started with --dashboard) prints it."""
        log_path = self.out_dir / "logs" / "bootstrap.log"
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(r"dashboard at (http://\S+)", log_path.read_text())
            if found:
                return found.group(1)
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap printed no dashboard address; see {log_path}")
            time.sleep(0.05)

    def start_node(self, stage: int, replica: int, *extra: str) -> NodeProcess:
        assert self.maddr is not None, "start_bootstrap() first"
        name = f"stage{stage}-r{replica}"
        ready = self.out_dir / "ready" / f"{name}.json"
        ready.unlink(missing_ok=True)
        log_path = self.out_dir / "logs" / f"{name}.log"
        with open(log_path, "a") as log:
            proc = self.group.spawn(
                self._cmd(
                    "join",
                    "--stage",
                    str(stage),
                    "--initial-peers",
                    self.maddr,
                    "--threads",
                    str(self.threads),
                    "--out",
                    str(self.out_dir / "nodes"),
                    "--ready-file",
                    str(ready),
                    # A launched swarm is one run's: no node resumes from an earlier run's checkpoint
                    # in the user's state folder (a test or cell passes checkpoint.dir when it wants one).
                    "--set",
                    "checkpoint.auto=false",
                    *extra,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
            )
        node = NodeProcess(stage, replica, proc, ready, log_path, extra=tuple(extra))
        self.nodes.append(node)
        return node

    def restart(self, node: NodeProcess) -> NodeProcess:
        """Start `node` again with the same stage, replica and arguments (its checkpoint dir
        included, so it resumes); the new process replaces it in `nodes`."""
        if node.proc.poll() is None:
            raise RuntimeError(f"{node.label} is still running")
        self.nodes.remove(node)
        return self.start_node(node.stage, node.replica, *node.extra)

    def wait_ready(
        self, nodes: list[NodeProcess] | None = None, on_wait: Callable[[list[NodeProcess]], None] | None = None
    ) -> None:
        """Until every one of `nodes` (all by default) wrote its ready file; `on_wait`, if given, is
        told which are not ready yet about twice a second."""
        deadline = time.monotonic() + self.startup_timeout_s
        waiting, told = list(nodes or self.nodes), 0.0
        for node in list(waiting):
            while not node.ready_file.exists():
                if node.proc.poll() is not None:
                    raise RuntimeError(f"{node.label} exited with {node.proc.returncode}; see {node.log_file}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.label} not ready in {self.startup_timeout_s} s; see {node.log_file}")
                if on_wait is not None and time.monotonic() - told >= 0.5:
                    on_wait([n for n in waiting if not n.ready_file.exists()])
                    told = time.monotonic()
                time.sleep(0.05)
            node.info = json.loads(node.ready_file.read_text())
            waiting.remove(node)

    def wait_exit(self, nodes: list[NodeProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for node in nodes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                node.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{node.label} still running after {timeout_s:.0f} s; see {node.log_file}") from None

    @staticmethod
    def terminate(proc: subprocess.Popen, grace_s: float = 15.0) -> int | None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode

    def kill(self, node: NodeProcess) -> None:
        node.proc.kill()
        node.proc.wait(timeout=10)

    def stop(self, grace_s: float = 45.0) -> None:
        """SIGTERM every node at once (they drain and checkpoint in parallel), SIGKILL whoever is
        still running after `grace_s`, then stop the bootstrap peer they were withdrawing from,
        then anything else left in the swarm's process group (a p2pd daemon, a child started
        as a stop signal arrived). The default covers a node's worst graceful exit: withdraw
        (connect_s) + finish an outer round (2 match_s + 10) + drain (drain_s), with the default
        timeouts."""
        running = [node.proc for node in self.nodes if node.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.bootstrap is not None:
            self.terminate(self.bootstrap)
        self.group.drain(grace_s=5.0)

    def node_stats(self) -> dict[str, dict]:
        """Stats files the nodes wrote on exit, keyed by peer id."""
        out = {}
        for path in sorted((self.out_dir / "nodes").glob("stage*.json")):
            stats = json.loads(path.read_text())
            out[stats["peer_id"]] = stats
        return out

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
