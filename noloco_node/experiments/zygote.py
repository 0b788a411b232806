"""The zygote: a process that has imported what every node imports and forks one child per request.

Why: a node spends 7-10 CPU-seconds importing torch, transformers (which pulls in torch._dynamo and
torch.distributed.tensor) and hivemind before it does anything of its own. A local swarm of nine
processes on a two-core laptop spent most of its first minute there, and the test suite most of its
CPU. Forked from here, a node starts with all of that already in memory (shared copy-on-write).

Run by preloaded.py as `python -m noloco_node.experiments.zygote FD MODULE...`: it imports the
MODULEs, then serves FD, one end of an AF_UNIX SOCK_SEQPACKET pair; one JSON message per packet:

    launcher -> zygote  {"argv": [...], "env": {...}, "cwd": "...", "pgid": N, "serial": S, "netns": NAME|null}
                        + fds stdin, stdout, stderr
    zygote -> launcher  {"ready": zygote_pid} or {"error": traceback}            once, after the imports
                        {"pid": N, "pgid": G, "serial": S}                       one per request
                        {"exited": N, "returncode": R}                           as each child ends

argv is what would follow `python`: ["-m", MODULE, *args] (launchers send MODULEs of noloco_node). The child
runs it as `python -m` would, and ends as an interpreter does (see _exit). It dies with the zygote
(PR_SET_PDEATHSIG=SIGTERM, as a node dies with
its launcher), and the zygote ends when the launcher closes its end or dies: children are never
orphaned without a signal. The zygote does no torch compute and opens no gRPC channel, so nothing
the fork copies is in use: a forked node is the same as an exec'd one after its imports.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback

from noloco_node.runtime.logging import quiet_native_logs

MAX_FDS = 3
MAX_MESSAGE = 1 << 20


def send(control: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    socket.send_fds(control, [json.dumps(message).encode()], list(fds))


def receive(control: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds that came with it; (None, []) once the other end is closed."""
    data, fds, _flags, _addr = socket.recv_fds(control, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a launcher may ignore them; exec keeps SIG_IGN
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    # What cli/main.py sets before a node's imports, set before ours: gRPC and hivemind read it when
    # they load (a node asked for DEBUG logs is exec'd instead: preloaded.preloadable).
    quiet_native_logs("INFO")
    try:
        for module in sys.argv[2:]:
            __import__(module)
    except BaseException:
        send(control, {"error": traceback.format_exc()})
        raise
    request, fds = _serve(control)  # returns only in a forked child
    module, args = _become(request, fds)
    sys.argv = [module, *args]  # run_module puts the module's path in argv[0], as `python -m` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
        sys.excepthook(*sys.exc_info())
    except BaseException:  # noqa: BLE001 - the interpreter's own last handler: print it, exit 1
        code = 1
        sys.excepthook(*sys.exc_info())
    _exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """End as the interpreter would (non-daemon threads joined, atexit handlers run, streams
    flushed) without tearing down every module: with torch loaded that teardown takes ~2 CPU-s
    and frees only memory the exit frees anyway. Files still open unflushed at exit would lose
    their buffers; the node's files are closed by `with` or written line-buffered."""
    import atexit
    import threading

    threading._shutdown()  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # as CPython does for an uncaught KeyboardInterrupt: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _serve(control: socket.socket) -> tuple[dict, list[int]]:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    send(control, {"ready": os.getpid()})
    while True:  # until the launcher closes its end: then every child has been or will be signalled
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                while _drained(wake_r):
                    pass
                _reap(control)
                continue
            request, fds = receive(control)
            if request is None:
                os._exit(0)
            request["zygote"] = os.getpid()
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                control.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            send(
                control,
                {"pid": pid, "pgid": _place_in_group(pid, request.get("pgid", 0)), "serial": request.get("serial")},
            )


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(control, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _place_in_group(pid: int, pgid: int) -> int:
    """Put a new child in the launcher's group (both sides call setpgid, as a shell does, so the
    launcher knows the group as soon as it knows the pid); pgid 0, or a group whose members have
    all exited, makes the child lead a group of its own."""
    for target in (pgid, 0) if pgid else (0,):
        try:
            os.setpgid(pid, target)
            break
        except PermissionError:
            continue
        except ProcessLookupError:
            break
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return pgid or pid


def _become(request: dict, fds: list[int]) -> tuple[str, list[str]]:
    """In the child: the process `python -m MODULE args` would have been, after its imports."""
    from noloco_node.experiments.process_group import STOP_SIGNALS, set_death_signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (*STOP_SIGNALS, signal.SIGCHLD))
    zygote = request["zygote"]  # not getppid(): the zygote may already be gone
    _place_in_group(0, request.get("pgid", 0))
    set_death_signal(signal.SIGTERM)
    if os.getppid() != zygote:  # the zygote died before prctl: no signal would ever come
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if request.get("netns"):
        _enter_network_namespace(request["netns"])
    _option, module, *args = request["argv"]  # ["-m", MODULE, ...]: preloaded.preloadable checks
    _set_title(module, args)  # before the environment changes: the title takes its place in memory
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reopen_std_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:  # Python's own `random` reseeds itself after a fork; numpy's does not
        sys.modules["numpy"].random.seed()
    return module, args


def _enter_network_namespace(name: str) -> None:
    """What `ip netns exec NAME` does for the network (the tests' NAT topologies): join the
    namespace bound at /run/netns/NAME; alone in the process, so every socket it opens is there."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r}")
    finally:
        os.close(fd)


def _reopen_std_streams(unbuffered: bool) -> None:
    def text(fd: int, mode: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        binary = (
            raw if unbuffered and mode == "w" else (io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw))
        )
        return io.TextIOWrapper(
            binary,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2,
            write_through=unbuffered,
        )

    sys.stdin = sys.__stdin__ = text(0, "r")
    sys.stdout = sys.__stdout__ = text(1, "w")
    sys.stderr = sys.__stderr__ = text(2, "w")


def _set_title(module: str, args: list[str]) -> None:
    """`ps` and /proc/PID/cmdline show the node's command, not the zygote's."""
    import setproctitle

    program = "noloco-node" if module == "noloco_node" else f"{sys.executable} -m {module}"
    setproctitle.setproctitle(" ".join([program, *args]))


if __name__ == "__main__":
    main()
