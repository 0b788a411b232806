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
