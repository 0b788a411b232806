"""Chaos for a LocalSwarm: every `every_s` seconds a random eligible node is killed and restarted
(SIGKILL, then the same command again: it resumes from its checkpoint), stalled (SIGSTOP for
`stall_s`, long enough for peers' deadlines to pass, then SIGCONT) or delayed (SIGSTOP for
`delay_s`, shorter than the deadlines). The bootstrap peer is never touched. Every action is
recorded with its time, so a report can line failures up with the training curves."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from noloco_node.experiments.launcher import LocalSwarm, NodeProcess

log = logging.getLogger(__name__)
ACTIONS = ("kill", "stall", "delay")


@dataclass(frozen=True)
class ChaosProfile:
    action: str = "kill"
    every_s: float = 10.0
    stall_s: float = 8.0
    delay_s: float = 1.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"chaos action {self.action!r}: use one of {', '.join(ACTIONS)}")
        if min(self.every_s, self.stall_s, self.delay_s) <= 0:
            raise ValueError("chaos every_s, stall_s and delay_s must be > 0")


class ChaosMonkey:
    def __init__(
        self,
        swarm: LocalSwarm,
        profile: ChaosProfile,
        *,
        seed: int = 0,
        eligible: Callable[[NodeProcess], bool] = lambda node: True,
    ) -> None:
        self.swarm, self.profile, self.eligible = swarm, profile, eligible
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.lock = threading.Lock()  # held while an action is under way (a node may be between processes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos", daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> ChaosMonkey:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.profile.stall_s + self.swarm.startup_timeout_s + 30)

    def wait_for_drivers(self, replicas: int, timeout_s: float) -> list[NodeProcess]:
        """Block until all `replicas` stage-0 processes have exited (restarted drivers replace
        killed ones in the swarm); returns the last process of each."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                drivers = [n for n in self.swarm.nodes if n.stage == 0]
                if len(drivers) == replicas and all(n.proc.poll() is not None for n in drivers):
                    return drivers
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"drivers still running after {timeout_s:.0f} s under chaos; chaos so far: {self.events}"
                )
            time.sleep(0.5)

    def _loop(self) -> None:
        while not self._stop.wait(self.profile.every_s):
            candidates = [n for n in self.swarm.nodes if n.proc.poll() is None and self.eligible(n)]
            if not candidates:
                continue
            node = self.rng.choice(candidates)
            try:
                with self.lock:
                    self._act(node)
            except Exception as exc:  # noqa: BLE001 - a failed action is recorded, the run goes on
                log.warning("chaos %s on %s failed: %s", self.profile.action, node.label, exc)
                self.events.append(self._event(node, f"{self.profile.action} failed: {exc}"))

    def _event(self, node: NodeProcess, what: str) -> dict:
        return {
            "t_s": round(time.monotonic() - self._start, 2),
            "node": node.label,
            "pid": node.proc.pid,
            "action": what,
        }

    def _act(self, node: NodeProcess) -> None:
        action = self.profile.action
        if action == "kill":
            node.proc.kill()
            node.proc.wait(timeout=10)
            self.events.append(self._event(node, "kill"))
            if self._stop.is_set():
                return
            fresh = self.swarm.restart(node)
            self.swarm.wait_ready([fresh])
            self.events.append(self._event(fresh, "restarted"))
        else:
            pause = self.profile.stall_s if action == "stall" else self.profile.delay_s
            os.kill(node.proc.pid, signal.SIGSTOP)
            self.events.append(self._event(node, f"{action} {pause:g} s"))
            self._stop.wait(pause)
            os.kill(node.proc.pid, signal.SIGCONT)
