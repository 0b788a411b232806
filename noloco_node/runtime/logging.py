"""Log format for node processes, set up once by the CLI; library code never adds handlers."""

from __future__ import annotations

import asyncio
import logging
import os
import sys


def setup_logging(level: str = "INFO", prefix: str = "") -> None:
    """Route all logs to stderr as `time level [prefix] logger: message`."""
    tag = f"[{prefix}] " if prefix else ""
    handler = _AroundTheProgressLine(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("hivemind", "datasets", "filelock", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    handler.addFilter(_not_our_reaped_daemon)
    handler.addFilter(_not_a_closed_daemon_stream)


def _not_our_reaped_daemon(record: logging.LogRecord) -> bool:
    """asyncio's child watcher warns of a child it could not wait for ("Unknown child process pid
    ..."): a libp2p daemon that failed to start is waited for by us (dht/daemon.py ReapedP2P), so
    the watcher finds it gone. Shown before the real error ("could not join the DHT"), it read as
    a second fault."""
    return not (record.name == "asyncio" and record.getMessage().startswith("Unknown child process pid"))


def _not_a_closed_daemon_stream(record: logging.LogRecord) -> bool:
    """hivemind's handler of the libp2p daemon's stream callbacks reads a message header from a
    stream the daemon has already closed (a peer that went away) and asyncio reports it as an
    ERROR with a traceback ("Unhandled exception in client_connected_cb ... IncompleteReadError"),
    which a newcomer saw 9 times in 30 min in every process while nothing was wrong. Kept for DEBUG."""
    if record.name != "asyncio" or "client_connected_cb" not in record.getMessage() or not record.exc_info:
        return True
    kind, _, trace = record.exc_info
    frames = []
    while trace is not None:
        frames.append(trace.tb_frame.f_code.co_filename)
        trace = trace.tb_next
    ours = (
        kind is not None
        and issubclass(kind, asyncio.IncompleteReadError)
        and any("p2p_daemon_bindings" in f for f in frames)
    )
    return not ours or logging.getLogger().level <= logging.DEBUG


class ProgressLine:
    """A single rewritten status line on a TTY; silent otherwise (logs stay clean). While it shows,
    a log line clears it, prints on a line of its own, and draws it again below (without that, a
    log line was glued to its end: `... | loss 4.37810:01:41 INFO ...`)."""

    shown: ProgressLine | None = None  # the line on screen now, for the log handler

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.text = ""

    def update(self, text: str) -> None:
        if self.enabled:
            self.text = text
            ProgressLine.shown = self
            self.stream.write("\r\033[K" + text)
            self.stream.flush()

    def clear(self) -> None:
        """Erase the line, for a line of plain output in its place; `update` draws it again."""
        if self.enabled and ProgressLine.shown is self:
            ProgressLine.shown = None
            self.stream.write("\r\033[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and ProgressLine.shown is self:
            ProgressLine.shown = None
            self.stream.write("\n")
            self.stream.flush()


class _AroundTheProgressLine(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        line = ProgressLine.shown
        if line is None or line.stream is not self.stream:
            super().emit(record)
            return
        self.stream.write("\r\033[K")
        super().emit(record)
        self.stream.write(line.text)
        self.stream.flush()


def quiet_native_logs(level: str) -> None:
    """Below DEBUG, keep libraries that log on their own out of the console: gRPC's C core (its
    INFO line 'fork_posix ... skipping fork() handlers' whenever a node process forks while gRPC
    threads run) and hivemind's own handler, which installs itself at INFO on import (so a process
    hivemind forks during start-up keeps INFO). Must run before either is imported (the CLI, and
    the zygote before its imports: experiments/zygote.py); inherited by child processes; a value
    the user set wins."""
    if level.upper() != "DEBUG":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")


def is_grpc_stream_leak(context: dict) -> bool:
    """Whether an asyncio error report is grpc.aio's known leak, not ours: a client-streaming call
    made through interceptors (ours sign every call) that the server ends before all was written (a
    busy or refusing receiver) leaves the task feeding it its requests pending (a fix was proposed
    upstream in grpc/grpc#37355; grpcio 1.85 still does it); when the call is collected, asyncio
    reports that task and the generator it read. The call itself failed with its status and was
    handled."""
    task = context.get("task")
    if task is not None and context.get("message") == "Task was destroyed but it is pending!":
        return getattr(task.get_coro(), "__qualname__", "") == "_StreamRequestMixin._consume_request_iterator"
    exc = context.get("exception")
    return isinstance(exc, RuntimeError) and str(exc) == "aclose(): asynchronous generator is already running"
