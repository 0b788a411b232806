"""How a node leaves: after a running outer step, withdrawn from the DHT first (peers stop routing
to it), its microbatches drained, its last checkpoint, snapshot and outputs written, then every
part closed within a deadline; and how a node whose start failed closes what it had opened."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from noloco_node.runtime.node_status import Status

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node

log = logging.getLogger(__name__)


async def leave(node: Node, grace_s: float | None = None, *, final: bool = True, same_stage: bool = False) -> None:
    """Finish a running outer step, withdraw the DHT record (status leaving), drain the
    microbatches in flight within `grace_s`, checkpoint, write stats (and weights), shut down.
    `final=False` (a move): no snapshot or outputs of this stage, and no checkpoint unless it comes
    back to the `same_stage` (node/catching_up.py: it keeps its own state, should no copy be had)."""
    cfg = node.config
    grace_s = cfg.timeouts.drain_s if grace_s is None else grace_s
    node.stopping = True
    node.events.emit("stopping", inner_step=node.worker.inner_steps, in_flight=len(node.runtime.in_flight))
    # Let a running outer step finish first, while our record still says we are here: withdrawn
    # first, a partner's lookup no longer found us and an overlapped round in flight at the end
    # went solo (seen in 8 of 20 overlapped loss_price cells); and the weights we save are post-update.
    # A fixed bound: launchers size their grace after SIGTERM by it (experiments/launcher.py).
    node.sync.wind_down()
    if not await node.sync.settle(cfg.timeouts.outer_round_s):
        log.warning("an outer step was still running at shutdown")
    node.board.become(Status.LEAVING)  # announced next, with the record withdrawn
    # A mover's leaving record outlives its trip to the new stage (a restart, a state fetch), so
    # no other node plans a move while this one is in transit (pipeline/rebalance.py).
    # Not one coming back to the same stage: its new record goes under the same key, and the DHT
    # keeps whichever value expires last (the new address went unseen for minutes).
    long_ttl = not final and not same_stage
    ttl_s = max(cfg.timeouts.record_ttl_s, 2 * cfg.pipeline.rebalance_period_s) if long_ttl else None
    try:  # withdraw first, so peers stop routing to us while we drain
        await asyncio.wait_for(node.announce(ttl_s), timeout=cfg.timeouts.connect_s)
    except Exception as exc:  # noqa: BLE001 - leaving anyway; the record expires by TTL
        log.info("could not withdraw our record (%r); it expires by its TTL", exc)
    await node.runtime.drain(grace_s)
    if final:
        await _say_if_last_replica(node)  # after the drain: the step it names is the one kept
        await _final_outputs(node)
    elif same_stage and node.checkpoints is not None:
        await node.boundary.checkpoint(node.driver)
    node.cancel_background()
    await _shut_down(node)


def last_replica_words(
    stage: int, others: int, inner_step: int, *, checkpoint_dir: str | None, weights_dir: str | None, run_done: bool
) -> tuple[int, str] | None:
    """What a leaving node says when no other replica of its stage is live (`others` == 0): the
    stage's trained weights then exist only here. None when another replica keeps them; a plain
    line when it never trained (a newcomer was warned of losing weights it never had). A warning
    only when nothing on disk keeps them and the node's run is not over (stage 0 trained all of
    its steps: the end of a run, not a loss)."""
    if others:
        return None
    if inner_step == 0:  # never trained here: its initial weights, which every node can build
        return (
            logging.INFO,
            f"no other replica of stage {stage} is serving now, and it was never trained here: nothing to keep",
        )
    # "Serving now", not "has no other replica": replicas that stop at the same moment (the end of an
    # experiment, a NAT audit's two volunteers) each see the other withdrawn.
    lead = f"no other replica of stage {stage} is serving now: its weights (inner step {inner_step})"
    if checkpoint_dir is not None:
        from noloco_node.node.checkpoint_home import state_home

        again = (
            "`join` again on this machine (same run) takes the stage back from it"
            if Path(checkpoint_dir).is_relative_to(state_home())
            else "`join` again with the same checkpoint.dir takes the stage back from it"
        )
        return logging.INFO, f"{lead} stay in the checkpoint in {checkpoint_dir}; {again}"
    if weights_dir is not None:
        return logging.INFO, f"{lead} are written to {weights_dir}"
    return logging.INFO if run_done else logging.WARNING, (
        f"{lead} leave with this node and nothing on disk keeps them, so the next node on stage {stage} "
        "starts it from its initial weights. To keep them: leave checkpoint.auto on (the default) or "
        "set checkpoint.dir, and join again (`noloco-node export` takes the model out of a live swarm)"
    )


async def _say_if_last_replica(node: Node) -> None:
    try:  # a fresh look (the heartbeat's count can be 10 s old), short: launchers bound a stop
        replicas = await asyncio.wait_for(node.directory.replicas(node.stage_index, fresh=True), 2.0)
        others = sum(r.peer_id != node.peer_id for r in replicas)
    except Exception as exc:  # noqa: BLE001 - leaving anyway: the heartbeat's count will do
        log.debug("could not look up our stage's replicas at leave: %r", exc)
        others = (node.stage_replicas or 2) - 1
    outputs = node.outputs
    words = last_replica_words(
        node.stage_index,
        others,
        node.worker.inner_steps,
        checkpoint_dir=node.config.checkpoint.dir,
        weights_dir=str(outputs.out_dir) if outputs.out_dir is not None and outputs.save_weights else None,
        run_done=node.done_at_step is not None,
    )
    if words is not None:
        log.log(*words)


async def _final_outputs(node: Node) -> None:
    if node.snapshots is not None:  # where training left this node, whatever inner step that is
        await node.snapshots.save(node.worker.inner_steps, final=True)
    if node.checkpoints is not None and node.worker.inner_steps > 0:  # at 0: the initial weights, nothing to keep
        await node.boundary.checkpoint(node.driver)
    if node.outputs.out_dir is not None:
        from noloco_node.node.outputs import write_outputs

        write_outputs(node, node.outputs.out_dir)


async def abandon(node: Node) -> None:
    """After a start that failed once the node was built (node/building.py closes what a failed
    build opened): close its page, gRPC server, libp2p links and DHT peer (no record to withdraw,
    nothing to drain), so the process exits quietly with the error that stopped it."""
    closers = {
        "dashboard": node.dashboard and node.dashboard.close,
        "server": lambda: node.server.stop(0),
        "outer sync": node.sync.close,  # an all-reduce method's averager processes
        "links": node.links.close,
        "dht": node.directory.shutdown,
    }
    for name, close in closers.items():
        if not close:
            continue
        try:
            await asyncio.wait_for(close(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - exiting with the start's error anyway
            log.debug("closing the %s after a failed start: %r", name, exc)
    if node.metrics is not None:
        node.metrics.stop()
    node.parts.compute.shutdown()


async def _shut_down(node: Node) -> None:
    timeout_s = node.config.timeouts.connect_s + 5
    await node.sync.close()
    dashboard = node.dashboard.close() if node.dashboard is not None else asyncio.sleep(0)
    for name, step in (
        ("dashboard", dashboard),
        ("server", node.server.stop(1.0)),
        ("client", node.client.close()),
        ("outer client", node.outer_client.close()),
        ("links", node.links.close()),
        ("dht", node.directory.shutdown()),
    ):
        try:
            await asyncio.wait_for(step, timeout=timeout_s)
        except asyncio.TimeoutError:
            log.warning("shutdown of the %s timed out; exiting anyway", name)
    if node.metrics is not None:
        node.metrics.stop()
    node.parts.compute.shutdown()
    node.events.emit("stopped", inner_step=node.worker.inner_steps, saved_inputs=len(node.worker.saved))
    node.events.close()
