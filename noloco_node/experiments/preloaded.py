"""Start `python -m noloco_node...` processes by forking the zygote (zygote.py) instead of exec'ing.

ProcessGroup.spawn routes here what it can: a command `sys.executable -m noloco_node...` whose
output goes to files (or nowhere). What it gets back is a PreloadedProcess, which answers as much
of subprocess.Popen as launchers use (pid, args, poll, wait, returncode, send_signal, terminate,
kill). One zygote serves every swarm this launcher starts, as long as the environment variables
that the imports read (the IMPORT_ENV ones) are the same; a zygote that cannot start, or a command
it cannot run, falls back to a plain exec, so this only ever changes how fast a node starts.
One thing to know when developing: a zygote runs the code it imported when it started, so a
launcher that outlives an edit of the source (a long test session) forks nodes that mix the old
modules with new ones imported later.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Mapping

from noloco_node.experiments.zygote import receive, send

log = logging.getLogger(__name__)

# Environment variables read while torch, transformers, tokenizers, hivemind and grpc import
# (thread pools, hub paths, offline flags, interpreter options): a zygote serves one set of them.
IMPORT_ENV = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "KMP_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "GRPC_",
    "LD_",
    "HOME",
    "XDG_",
    "TMPDIR",
)
# What `join`, `bootstrap` and the experiments' outer peers import before they do anything.
NODE_IMPORTS = (
    "torch",
    "numpy",
    "grpc",
    "hivemind",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "noloco_node.cli.main",
    "noloco_node.cli.join",
    "noloco_node.cli.bootstrap",
    "noloco_node.node.assembly",
    "noloco_node.node.lifecycle",
    "noloco_node.experiments.outer_peer",
)
READY_TIMEOUT_S = 180.0  # the zygote's imports: ~10 s on an idle laptop, far more on a loaded CI box
REPLY_TIMEOUT_S = 30.0
MAX_ZYGOTES = 2
POPEN_KEYS = {"stdin", "stdout", "stderr", "env", "cwd"}


class ZygoteUnavailable(RuntimeError):
    """The zygote could not start or stopped answering; the caller execs instead."""


class PreloadedProcess:
    """A process forked by a zygote: the parts of subprocess.Popen a launcher uses."""

    def __init__(self, zygote: Zygote, serial: int, pid: int, args: list[str]) -> None:
        self._zygote, self._serial = zygote, serial
        self.pid, self.args = pid, args

    @property
    def returncode(self) -> int | None:
        return self._zygote.returncode(self._serial, self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait(self._serial, self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __repr__(self) -> str:
        return f"<PreloadedProcess pid={self.pid} returncode={self.returncode} args={self.args!r}>"


class Zygote:
    """One zygote process and the children it forked for this launcher."""

    def __init__(
        self, env: Mapping[str, str], start: Callable[..., subprocess.Popen], preload: tuple[str, ...] = NODE_IMPORTS
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = start(
                [sys.executable, "-m", "noloco_node.experiments.zygote", str(theirs.fileno()), *preload],
                pass_fds=(theirs.fileno(),),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._control = ours
        self._replies: queue.Queue[dict] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._serial_of: dict[int, int] = {}  # pid -> serial of the live child with that pid
        self._next_serial = 0
        self._changed = threading.Condition()
        self._request_lock = threading.Lock()
        self.lost = False
        ours.settimeout(READY_TIMEOUT_S)
        try:
            first, _ = receive(ours)
        except (OSError, ValueError) as exc:
            self._abandon()
            raise ZygoteUnavailable(f"the zygote did not start in {READY_TIMEOUT_S:.0f} s ({exc})") from None
        if not first or "ready" not in first:
            self._abandon()
            raise ZygoteUnavailable(
                f"the zygote could not import what nodes need:\n{(first or {}).get('error', 'it exited')}"
            )
        ours.settimeout(None)
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        pgid: int,
        fds: tuple[int, int, int],
        netns: str | None = None,
    ) -> tuple[PreloadedProcess, int]:
        """Fork a child running `python *argv` (inside network namespace `netns` when given);
        (the process, the group it is in)."""
        with self._request_lock:
            if self.lost:
                raise ZygoteUnavailable("the zygote has exited")
            self._next_serial += 1
            serial = self._next_serial
            send(
                self._control,
                {"argv": argv, "env": dict(env), "cwd": cwd, "pgid": pgid, "serial": serial, "netns": netns},
                fds,
            )
            try:
                reply = self._replies.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise ZygoteUnavailable(f"the zygote did not answer in {REPLY_TIMEOUT_S:.0f} s") from None
        if "pid" not in reply:
            raise ZygoteUnavailable("the zygote has exited")
        return PreloadedProcess(self, serial, reply["pid"], [sys.executable, *argv]), reply["pgid"]

    def returncode(self, serial: int, pid: int) -> int | None:
        with self._changed:
            return self._settled(serial, pid)

    def wait(self, serial: int, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: self._settled(serial, pid) is not None, timeout)
            return self._settled(serial, pid)

    def live_children(self) -> int:
        with self._changed:
            return len(self._serial_of)

    def close(self) -> None:
        """The zygote exits; children it still has get SIGTERM (their death signal)."""
        try:
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._control.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _settled(self, serial: int, pid: int) -> int | None:
        if serial not in self._exits and self.lost and not _alive(pid):
            self._exits[serial] = 255  # orphaned when the zygote died: its status is gone with it
        return self._exits.get(serial)

    def _read(self) -> None:
        while True:
            try:
                message, fds = receive(self._control)
            except (OSError, ValueError):
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            if message is None:
                with self._changed:
                    self.lost = True
                    self._changed.notify_all()
                self._replies.put({})
                return
            with self._changed:
                if "exited" in message:
                    serial = self._serial_of.pop(message["exited"], None)
                    if serial is not None:
                        self._exits[serial] = message["returncode"]
                        self._changed.notify_all()
                    continue
                if "pid" in message:
                    self._serial_of[message["pid"]] = message["serial"]
            self._replies.put(message)

    def _abandon(self) -> None:
        self.lost = True
        self._control.close()
        self.proc.kill()
        self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def import_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV)))


def preloadable(cmd: list[str], popen_kwargs: dict[str, Any]) -> bool:
    """A command the zygote can run, with output it can hand over: files, fds or nowhere."""
    levels = [b for a, b in zip(cmd, cmd[1:]) if a == "--log-level"]
    levels += [a.split("=", 1)[1] for a in cmd if a.startswith("--log-level=")]
    wants_debug_logs = any(level.upper() == "DEBUG" for level in levels)
    return (
        not wants_debug_logs  # the zygote loaded gRPC and hivemind with their native logs quiet
        and len(cmd) >= 3
        and cmd[0] == sys.executable
        and cmd[1] == "-m"
        and (cmd[2] == "noloco_node" or cmd[2].startswith("noloco_node."))
        and set(popen_kwargs) <= POPEN_KEYS
        and all(popen_kwargs.get(k) is not subprocess.PIPE for k in ("stdin", "stdout", "stderr"))
    )


def std_fds(popen_kwargs: dict[str, Any]) -> tuple[tuple[int, int, int], list[int]]:
    """(stdin, stdout, stderr) fds for the child as Popen would give them; the second list are fds
    opened here, to close once the zygote has its copies."""
    opened: list[int] = []

    def fd_of(value: Any, default: int) -> int:
        if value is None:
            return default
        if value == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR))
            return opened[-1]
        return value if isinstance(value, int) else value.fileno()

    stdin = fd_of(popen_kwargs.get("stdin"), 0)
    stdout = fd_of(popen_kwargs.get("stdout"), 1)
    stderr_value = popen_kwargs.get("stderr")
    stderr = stdout if stderr_value == subprocess.STDOUT else fd_of(stderr_value, 2)
    return (stdin, stdout, stderr), opened


class Zygotes:
    """This launcher's zygotes, one per IMPORT_ENV set, at most MAX_ZYGOTES alive."""

    def __init__(self) -> None:
        self._by_env: dict[tuple, Zygote] = {}
        self._failed: set[tuple] = set()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self, env: Mapping[str, str], start: Callable[..., subprocess.Popen]) -> Zygote | None:
        key = import_env(env)
        with self._lock:
            zygote = self._by_env.get(key)
            if zygote is not None and not zygote.lost:
                self._by_env[key] = self._by_env.pop(key)  # most recently used last
                return zygote
            if key in self._failed or not self._make_room():
                return None
            try:
                self._by_env[key] = Zygote(env, start)
            except (ZygoteUnavailable, OSError) as exc:
                log.warning("starting nodes without a zygote (each imports torch itself): %s", exc)
                self._failed.add(key)
                return None
            return self._by_env[key]

    def _make_room(self) -> bool:
        for key, zygote in list(self._by_env.items()):
            if zygote.lost:
                del self._by_env[key]
        for key, zygote in list(self._by_env.items()):
            if len(self._by_env) < MAX_ZYGOTES:
                break
            if zygote.live_children() == 0:
                self._by_env.pop(key).close()
        return len(self._by_env) < MAX_ZYGOTES

    def close(self) -> None:
        with self._lock:
            for zygote in self._by_env.values():
                zygote.close()
            self._by_env.clear()
