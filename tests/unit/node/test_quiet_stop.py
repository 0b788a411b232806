"""What a volunteer's Ctrl-C leaves in the log: the signal reaches the node's libp2p daemon too, so a
heartbeat that fails while the node stops is an INFO line, not an ERROR with a traceback (it still is
one while the node runs); and shutting a DHT node down cancels the cache refresh task hivemind
leaves pending (collected later, asyncio logged it as an ERROR after every relayed node's DHT
restart)."""

import asyncio
import logging
from types import SimpleNamespace

from hivemind.dht.crypto import RSASignatureValidator

from noloco_node.dht.directory import PeerDirectory
from noloco_node.node.presence import heartbeat
from noloco_node.transport.identity import NodeIdentity

from ..dht.test_directory_lookups import IDENTITY, ScriptedDHT


class DaemonGone:
    def sample(self, **_) -> None:
        raise ConnectionRefusedError("the libp2p daemon's control socket is gone")


def failing_node(stopping: bool) -> SimpleNamespace:
    """As much of a Node as the heartbeat reads before its first call fails."""
    return SimpleNamespace(
        stopping=stopping,
        config=SimpleNamespace(timeouts=SimpleNamespace(heartbeat_s=0.01)),
        meter=DaemonGone(),
        worker=SimpleNamespace(sequences_total=0),
        parts=SimpleNamespace(compute=SimpleNamespace(busy_s=0.0)),
        runtime=SimpleNamespace(in_flight={}),
        pipeline=None,
    )


def heartbeat_records(node, caplog) -> list[logging.LogRecord]:
    async def main():
        task = asyncio.ensure_future(heartbeat(node))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="noloco_node.node.presence"):
        asyncio.run(main())
    return [r for r in caplog.records if r.name == "noloco_node.node.presence"]


def test_a_heartbeat_failing_while_the_node_stops_is_info_and_while_it_runs_an_error(caplog):
    node = failing_node(stopping=False)
    node.config.pipeline = SimpleNamespace(max_in_flight=4)
    running = heartbeat_records(node, caplog)
    assert running and all(r.levelno == logging.ERROR and r.exc_info for r in running)
    node.stopping = True
    stopping = heartbeat_records(node, caplog)
    assert stopping and all(r.levelno == logging.INFO and not r.exc_info for r in stopping)
    assert "control socket is gone" in stopping[0].getMessage()


def test_shutting_the_directory_down_cancels_hiveminds_cache_refresh_task():
    me = NodeIdentity.generate()

    async def main():
        dht = ScriptedDHT(me)
        dht.cache_refresh_task = asyncio.ensure_future(asyncio.sleep(3600))

        async def shutdown():
            dht.is_alive = False

        dht.shutdown = shutdown
        directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
        directory._own_p2p = SimpleNamespace(shutdown=shutdown)  # the daemon PeerDirectory.start would own
        await directory.shutdown(timeout_s=1.0)
        await asyncio.sleep(0)
        return dht.cache_refresh_task.cancelled()  # asked here: asyncio.run cancels what is left

    assert asyncio.run(main())
