"""Free loopback ports and the relay process that puts a link profile in front of them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from noloco_node.experiments.process_group import ProcessGroup
from noloco_node.netem.relay import LinkProfile


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (bound together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class RelayProcess:
    """One process relaying listen port -> upstream port for every route, with `profile`."""

    def __init__(self, profile: LinkProfile, routes: dict[int, int], work_dir: Path) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        ready = work_dir / "relay.ready"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "noloco_node.netem.relay",
            "--name",
            profile.name,
            "--one-way-ms",
            str(profile.one_way_ms),
            "--jitter-ms",
            str(profile.jitter_ms),
            "--mbit",
            str(profile.mbit),
            "--ready-file",
            str(ready),
        ]
        for listen, upstream in routes.items():
            cmd += ["--route", f"{listen}=127.0.0.1:{upstream}"]
        self.log = open(work_dir / "relay.log", "w")
        self.proc = ProcessGroup().spawn(cmd, stdout=self.log, stderr=subprocess.STDOUT)  # dies with the launcher
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"relay did not start; see {work_dir / 'relay.log'}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
