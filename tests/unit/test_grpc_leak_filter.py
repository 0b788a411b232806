"""grpc.aio's known leak of a cut stream's request task is reported at DEBUG on a node's loop;
every other asyncio error report is still an ERROR."""

import asyncio
import logging

from noloco_node.runtime.logging import is_grpc_stream_leak


class _StreamRequestMixin:
    """Stands in for grpc.aio's class: the leaked task's coroutine has its qualified name."""

    async def _consume_request_iterator(self):
        await asyncio.sleep(3600)


async def _ours():
    await asyncio.sleep(3600)


def test_only_grpcs_request_task_and_its_generator_are_recognised():
    async def main():
        leaked = asyncio.ensure_future(_StreamRequestMixin()._consume_request_iterator())
        mine = asyncio.ensure_future(_ours())
        await asyncio.sleep(0)
        pending = "Task was destroyed but it is pending!"
        verdicts = [
            is_grpc_stream_leak({"message": pending, "task": leaked}),
            is_grpc_stream_leak({"message": pending, "task": mine}),
            is_grpc_stream_leak(
                {
                    "message": "Task exception was never retrieved",
                    "exception": RuntimeError("aclose(): asynchronous generator is already running"),
                }
            ),
            is_grpc_stream_leak({"message": "Task exception was never retrieved", "exception": RuntimeError("boom")}),
            is_grpc_stream_leak({"message": "Unclosed connection"}),
        ]
        leaked.cancel()
        mine.cancel()
        return verdicts

    assert asyncio.run(main()) == [True, False, True, False, False]


def test_a_nodes_loop_reports_grpcs_leak_at_debug_and_everything_else_as_before(caplog):
    from noloco_node.cli.common import stop_on_signals

    async def main():
        stop_on_signals()  # a node's loop: its signal handlers and its error report handler
        loop = asyncio.get_running_loop()
        loop.call_exception_handler(
            {"message": "Task exception was never retrieved", "exception": RuntimeError("boom")}
        )
        loop.call_exception_handler(
            {
                "message": "Task exception was never retrieved",
                "exception": RuntimeError("aclose(): asynchronous generator is already running"),
            }
        )

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "boom" in str(errors[0].exc_info[1])  # ours: still an ERROR
    assert any(r.levelno == logging.DEBUG and "cut stream" in r.getMessage() for r in caplog.records)


def test_hiveminds_read_of_a_closed_daemon_stream_is_kept_for_debug():
    """hivemind reads a header from a stream the libp2p daemon closed (a peer went away): asyncio
    reported it as an ERROR with a traceback in every process (a newcomer saw 9 in 30 min)."""
    import sys

    from noloco_node.runtime.logging import _not_a_closed_daemon_stream

    code = compile(
        "async def _handler(reader):\n    raise asyncio.IncompleteReadError(b'', 1)\n",
        "/venv/hivemind/p2p/p2p_daemon_bindings/control.py",
        "exec",
    )
    scope = {"asyncio": asyncio}
    exec(code, scope)

    def record_of(coro_fn, message="Unhandled exception in client_connected_cb") -> logging.LogRecord:
        try:
            asyncio.run(coro_fn(None))
        except Exception:  # noqa: BLE001 - the exception is what the record carries
            info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, info)

    async def ours(reader):
        raise asyncio.IncompleteReadError(b"", 1)

    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.INFO)
        assert not _not_a_closed_daemon_stream(record_of(scope["_handler"]))
        assert _not_a_closed_daemon_stream(record_of(ours))  # not hivemind's: still an ERROR
        assert _not_a_closed_daemon_stream(record_of(scope["_handler"], "Task exception was never retrieved"))
        root.setLevel(logging.DEBUG)
        assert _not_a_closed_daemon_stream(record_of(scope["_handler"]))
    finally:
        root.setLevel(level)
