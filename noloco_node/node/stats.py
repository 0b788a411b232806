"""One read model of a running node: `node_stats` reads a Node's parts once into a typed
`NodeStats` (runtime/node_stats.py), each part reporting its own numbers, and everything that
reports on a node reads it: the stats file (its `to_dict()`), /metrics, experiments, join's step
lines and summary (node/reporting.py); `ready_fields` is join's ready file."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from noloco_node import __version__
from noloco_node.dht.records import StageRecord
from noloco_node.node.attention import NodeView, attention, for_record
from noloco_node.node.catching_up import copy_again_in_vain
from noloco_node.node.reporting import Snapshot
from noloco_node.runtime.memory import peak_memory_bytes
from noloco_node.runtime.node_stats import IntegrityStats, NodeStats, RoundBytes, TransportStats, WorkStats

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node


def node_stats(node: Node) -> NodeStats:
    """Everything a node reports about itself: the stats file, /metrics and experiments read it."""
    rounds = node.traits.outer_rounds
    return NodeStats(
        peer_id=node.peer_id,
        stage=node.stage_index,
        address=node.address,
        work=_work_stats(node),
        tokens_per_s=node.tokens_per_s,
        attention=node.attention(),
        admission=node.admission.stats_view(),
        transport=TransportStats(
            links=node.links.stats_view(),
            impostor_records=node.directory.impostor_records,
            impostor_calls=node.admission.interceptor.impostors,
            cut_at_receive_deadline=node.servicer.cut_at_deadline,
        ),
        integrity=_integrity_stats(node),
        routing_bans=node.pipeline.bans.banned_peers(),
        faults_fired=[f"{point}:{action}" for point, action in node.faults.fired],
        outer=node.sync.stats_view() if node.traits.syncs else None,
        outer_round=node.outer_round if rounds else None,
        fetched_state=node.fetched_state if rounds else None,
        resumed_from=node.resumed_from,
        movable=node.movable,
        moves=node.moves,
        driver=node.driver.stats_view() if node.driver is not None else None,
        inherited_microbatches=_inherited_microbatches(node),
    )


def _work_stats(node: Node) -> WorkStats:
    """What the node's stage computed, sent, received and routed: its runtime's, worker's,
    router's, client's and servicer's counters."""
    s, worker, router = node.runtime.stats, node.worker, node.runtime.router
    return WorkStats(
        inner_steps=worker.inner_steps,
        last_lr=worker.last_lr,
        sequences=worker.sequences_total,
        tokens=worker.tokens_total,
        forwards_received=dict(s.forwards_received),
        forwards_sent=s.forwards_sent,
        backwards_sent=s.backwards_sent,
        send_failures=s.send_failures,
        dropped_here=s.dropped_here,
        expired=s.expired,
        busy_answers=s.busy_answers,
        routed_balanced=s.routed_balanced,
        routed_random=s.routed_random,
        routed_to=dict(s.routed_to),
        routed_by_capacity=dict(router.measured_picks),
        routed_expected={p: round(v, 3) for p, v in router.measured_shares.items()},
        throughput=node.meter.record_fields(),
        bytes_sent=node.client.bytes_sent,
        rejected=dict(node.servicer.rejected),
        saved_inputs=len(worker.saved),
        bans=node.pipeline.bans.total,
        in_flight=len(node.runtime.in_flight),
        bytes_received=node.servicer.bytes_received,
    )


def _integrity_stats(node: Node) -> IntegrityStats:
    """Steps skipped, weights repaired and payloads refused for not being finite."""
    worker = node.worker
    return IntegrityStats(
        skipped_steps=worker.inner.skipped_steps,
        weights_repaired=worker.repairs,
        dropped_non_finite=worker.dropped_non_finite,
        payloads_refused=node.servicer.rejected.get("poisoned", 0),
    )


def _inherited_microbatches(node: Node) -> dict[str, int] | None:
    """Restarted at its last step, a stage 0 with nothing left to train has no driver: its
    predecessor's accounting is the driver's whole story: from the checkpoint it resumed, or from
    its move's record when it copied its stage's state again and the copy was at its last step
    (seen once in test_chaos: a recopy at step 55 of 60 landed at 60)."""
    if node.driver is not None or node.stage_index != 0:
        return None
    if (node.resumed_from or {}).get("microbatches"):
        return dict(node.resumed_from["microbatches"])
    if node.moves and node.moves[-1].get("microbatches"):
        return dict(node.moves[-1]["microbatches"])
    return None


def training_snapshot(stats: NodeStats) -> Snapshot:
    """The numbers a step line and the summary need, from `node_stats`."""
    work, driver, outer = stats.work, stats.driver, stats.outer
    losses = driver.step_losses if driver is not None else []
    lrs = driver.lrs if driver is not None else []
    return Snapshot(
        stage=stats.stage,
        step=driver.logged_step if driver is not None and driver.logged_step is not None else work.inner_steps,
        tokens=work.tokens,
        lr=lrs[-1] if lrs else (work.last_lr or None),
        loss=losses[-1] if losses else None,
        first_loss=losses[0] if losses else None,
        in_flight=work.in_flight,
        served=work.served,
        outer=outer.counts.to_dict() if outer is not None else None,
        last_round=outer.last_round if outer is not None else None,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        dropped=driver.microbatches.dropped if driver is not None else work.dropped_here,
        issued=driver.microbatches.issued if driver is not None else None,
        attention=tuple(stats.attention),
        round_bytes=outer.bytes_per_round if outer is not None else None,
    )


def ready_fields(node: Node) -> dict:
    """What `join --ready-file` reports, refreshed every 0.1 s (launchers and tests read it)."""
    return {
        "peer_id": node.peer_id,
        "address": node.address,
        "stage": node.stage_index,
        "reach": node.links.reach,
        "tls_cert": node.links.certificate.b64,
        "p2p_addrs": node.links.p2p_addrs,
        "inner_step": node.worker.inner_steps,
        "outer_round": node.outer_round,
        "status": node.status,
        "metrics_port": node.metrics_port,
        "dashboard_port": node.dashboard.port if node.dashboard else None,
        "manifest_hash": node.manifest_hash,
        "run_id": node.config.run.run_id,
        "in_flight": [[k.origin, k.sequence, k.attempt] for k in list(node.runtime.in_flight)],
        "saved_inputs": len(node.worker.saved),
        "moves": len(node.moves),
        "served": sum(node.runtime.stats.forwards_received.values()),
        "waiting_for": node.progress.waiting_for,
        "done_at_step": node.done_at_step,
    }


def stage_record(node: Node) -> StageRecord:
    """What the node announces about itself in the DHT (dht/records.py)."""
    moves, parts, links = node.moves, node.parts, node.links
    return StageRecord(
        peer_id=node.peer_id,
        address=node.address,
        stage=node.stage_index,
        inner_step=node.worker.inner_steps,
        outer_round=node.outer_round,
        status=node.status,
        tokens_per_s=node.tokens_per_s,
        version=__version__,
        manifest_hash=node.manifest_hash,
        run_id=node.config.run.run_id,
        updated_at=time.time(),
        reach=links.update_reach(),
        tls_cert=links.certificate.b64,
        p2p_addrs=links.p2p_addrs[:16],
        movable=node.movable,
        moved_at=float(moves[-1]["at"]) if moves else 0.0,
        move_claimed_at=node.move_claimed_at,
        memory_estimate_bytes=parts.memory_estimate_bytes,
        memory_peak_bytes=max(0, peak_memory_bytes(parts.device) - parts.memory_baseline_bytes),
        outer_round_bytes=RoundBytes.last_of(node.sync.counters.history) if node.traits.syncs else 0,
        loss=last_loss(node),
        attention=for_record(node_attention(node)),
        **node.meter.record_fields(),
    )


def last_loss(node: Node) -> float | None:
    """Stage 0's last microbatch loss, when there is one and it is a number a record may carry."""
    losses = node.driver.log.losses if node.driver is not None else []
    loss = float(losses[-1]) if losses else None
    return loss if loss is not None and math.isfinite(loss) and 0.0 <= loss <= 1e6 else None


def node_attention(node: Node) -> list[str]:
    """node/attention.py's warnings for this node, from what it observed."""
    node.progress.observe(node.worker.inner_steps)
    traits = node.traits
    return attention(
        NodeView(
            stage=node.stage_index,
            rounds_go_solo=traits.outer_rounds,
            all_reduce=traits.all_reduce,
            replicas_of_stage=node.stage_replicas,
            outer_history=node.sync.counters.history if traits.syncs else [],
            since_progress_s=node.progress.since_progress_s(),
            waiting_for=node.progress.waiting_for,
            done=node.done_at_step is not None or node.run_finished_at is not None,
            other_config_peers=len(node.directory.other_config_peers),
            copied_in_vain=copy_again_in_vain(node.sync.counters.history, node.moves) if traits.syncs else False,
        )
    )
