"""One process group per local swarm, so that stopping the launcher stops all of it.

Why: each node used to get its own session, so nothing tied it to the launcher: a `demo` ended by
SIGTERM (`timeout`, systemd, CI) left its bootstrap peer and nodes running. Here the first child
leads a new process group in the launcher's session and the others join it, so one `killpg`
reaches the whole swarm, grandchildren (p2pd) included. The launcher stays outside the group, so
a terminal's Ctrl-C reaches only the launcher, which drains the swarm itself (`raise_on_signals`
turns SIGTERM/SIGINT/SIGHUP into an exception that unwinds through the swarm's `finally`). A
SIGKILLed launcher runs no handler, so each child also sets PR_SET_PDEATHSIG=SIGTERM.

Linux sends that signal when the *thread* that forked the child exits, not the process: spawns
from other threads than the main one (the chaos monkey restarts nodes from its own) are done by
one daemon thread that lives as long as the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from noloco_node.experiments.preloaded import PreloadedProcess, Zygote, Zygotes, ZygoteUnavailable, preloadable, std_fds

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # absent outside Linux


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; a KeyboardInterrupt so that `except Exception` cannot swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def raise_on_signals(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Raise Interrupted in the main thread on the first of `signals`. Repeats are ignored while
    the context is open, so a second SIGTERM cannot cut the swarm's (bounded) drain short."""
    seen: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not seen:
            seen.append(signum)
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def set_death_signal(sig: int) -> None:
    """Have the kernel send `sig` to this process when the thread that forked it exits."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _child_setup(launcher: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the spawner around fork
        set_death_signal(signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before prctl: no signal will ever come
            os._exit(1)

    return setup


_spawner = ThreadPoolExecutor(
    1,
    "process-group-spawner",  # never exits before the process
    initializer=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS),
)


def _start_zygote(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """The zygote: in a group of its own (a terminal's signals are the launcher's, and draining a
    swarm must not stop it), dying with the launcher like every child."""

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, process_group=0, preexec_fn=_child_setup(os.getpid()), **popen_kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    return _spawner.submit(start).result()


_zygotes = Zygotes()


class ProcessGroup:
    """The processes of one swarm: `spawn` them, `drain` them all (grandchildren too).

    With `preload` (the default), `python -m noloco_node...` commands are forked from a zygote
    that has done their imports already (preloaded.py): the same process 7-10 CPU-seconds sooner."""

    def __init__(self, preload: bool = True) -> None:
        self.pgid: int | None = None
        self.procs: list[subprocess.Popen | PreloadedProcess] = []
        self.preload = preload
        self._lock = threading.Lock()

    def spawn(
        self, cmd: Sequence[str], *, netns: str | None = None, **popen_kwargs: Any
    ) -> subprocess.Popen | PreloadedProcess:
        """`Popen(cmd, **popen_kwargs)` in this group, with the launcher's death signal set;
        `netns`: inside that network namespace, as `ip netns exec NETNS cmd` would run it."""
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)  # a background group must not read the tty
        cmd = list(cmd)
        if self.preload and preloadable(cmd, popen_kwargs):
            zygote = _zygotes.get(popen_kwargs.get("env") or os.environ, _start_zygote)
            if zygote is not None:
                try:
                    return self._fork(zygote, cmd, popen_kwargs, netns)
                except ZygoteUnavailable as exc:
                    log.warning("starting %s without the zygote: %s", cmd[2], exc)
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        if threading.current_thread() is threading.main_thread():
            return self._spawn(cmd, popen_kwargs)
        return _spawner.submit(self._spawn, cmd, popen_kwargs).result()

    def _fork(self, zygote: Zygote, cmd: list[str], kwargs: dict, netns: str | None) -> PreloadedProcess:
        fds, opened = std_fds(kwargs)
        try:
            with self._lock:
                proc, pgid = zygote.spawn(
                    cmd[1:],
                    kwargs.get("env") or os.environ,
                    str(kwargs.get("cwd") or os.getcwd()),
                    self.pgid or 0,
                    fds,
                    netns,
                )
                self.pgid = pgid  # ours, or the child's own where every member of ours had exited
                self.procs.append(proc)
                return proc
        finally:
            for fd in opened:
                os.close(fd)

    def _spawn(self, cmd: list[str], kwargs: dict) -> subprocess.Popen:
        setup = _child_setup(os.getpid())
        # Blocked until the Popen is recorded, so no Interrupted can lose a started child.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            with self._lock:
                try:
                    proc = subprocess.Popen(cmd, process_group=self.pgid or 0, preexec_fn=setup, **kwargs)
                except PermissionError:
                    if self.pgid is None:
                        raise
                    # setpgid is refused once every member has exited: this child leads a new group.
                    proc = subprocess.Popen(cmd, process_group=0, preexec_fn=setup, **kwargs)
                    self.pgid = proc.pid
                self.pgid = self.pgid or proc.pid
                self.procs.append(proc)
                return proc
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def members(self) -> list[int]:
        """Pids of the group's live (not zombie) processes, ours and their descendants."""
        found = []
        for entry in os.scandir("/proc") if self.pgid is not None else ():
            if entry.name.isdigit():
                try:
                    stat = Path(entry.path, "stat").read_text()
                except OSError:
                    continue
                state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
                if state != "Z" and int(pgrp) == self.pgid:
                    found.append(int(entry.name))
        return found

    def signal(self, sig: int) -> None:
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.members():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        for proc in self.procs:  # all gone or zombies now: reap ours
            proc.wait(timeout=1)
        return True

    def drain(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, wait up to `grace_s` for all of it to exit, then SIGKILL the rest."""
        if not self._wait_empty(0):
            self.signal(signal.SIGTERM)
            if not self._wait_empty(grace_s):
                self.signal(signal.SIGKILL)
                self._wait_empty(10.0)
