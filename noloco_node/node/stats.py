"""One read model of a running node: `node_stats` reads a Node's parts once, and everything
that reports on a node reads its output: the stats file, /metrics, experiments, join's step lines
and summary (node/reporting.py) and its ready file."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from noloco_node import __version__
from noloco_node.dht.records import StageRecord
from noloco_node.node.attention import NodeView, attention
from noloco_node.node.reporting import Snapshot
from noloco_node.runtime.memory import peak_memory_bytes

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node


def node_stats(node: Node) -> dict:
    """Everything a node reports about itself: the stats file, /metrics and experiments read it."""
    out = _work_stats(node)
    out["admission"] = _admission_stats(node)
    out["transport"] = _transport_stats(node)
    out["integrity"] = _integrity_stats(node)
    out["routing_bans"] = node.pipeline.bans.banned_peers()
    out["faults_fired"] = [f"{point}:{action}" for point, action in node.faults.fired]
    out.update(_outer_stats(node))
    out["resumed_from"] = node.resumed_from
    out["movable"] = node.movable
    out["moves"] = node.moves  # each: from, to, at, inner_step, and the stage-0 driver's microbatches before it
    out.update(_driver_stats(node))
    return out


def _work_stats(node: Node) -> dict:
    """What the node's stage computed, sent, received and routed."""
    s = node.runtime.stats
    return {
        "peer_id": node.peer_id,
        "stage": node.stage_index,
        "address": node.address,
        "inner_steps": node.worker.inner_steps,
        "last_lr": node.worker.last_lr,
        "sequences": node.worker.sequences_total,
        "tokens": node.worker.tokens_total,
        "forwards_received": dict(s.forwards_received),
        "forwards_sent": s.forwards_sent,
        "backwards_sent": s.backwards_sent,
        "send_failures": s.send_failures,
        "dropped_here": s.dropped_here,
        "expired": s.expired,
        "busy_answers": s.busy_answers,
        "routed": {"balanced": s.routed_balanced, "random": s.routed_random},
        "routed_to": dict(s.routed_to),
        "routed_by_capacity": dict(node.runtime.router.measured_picks),
        "routed_expected": {p: round(v, 3) for p, v in node.runtime.router.measured_shares.items()},
        "throughput": node.meter.record_fields(),
        "bytes_sent": node.client.bytes_sent,
        "rejected": dict(node.servicer.rejected),
        "saved_inputs": len(node.worker.saved),
        "bans": node.pipeline.bans.total,
        "in_flight": len(node.runtime.in_flight),
        "bytes_received": node.servicer.bytes_received,
        "tokens_per_s": node.tokens_per_s,
        "attention": node.attention(),
    }


def _admission_stats(node: Node) -> dict:
    """Calls refused before any servicer ran, and the guard's bans and limits."""
    guard = node.admission.guard
    return {
        "swarm_key": node.admission.key is not None,
        "refused": dict(node.admission.interceptor.refused),
        "peers_banned": guard.stats.bans,
        "banned_now": guard.banned(),
        "rate_limited": guard.stats.rate_limited,
        "over_stream_cap": guard.stats.over_stream_cap,
        "refused_banned": guard.stats.refused_banned,
        "tracked_peers": guard.tracked(),
    }


def _transport_stats(node: Node) -> dict:
    """How peers reach the node, the bytes per path, and what the transport refused."""
    links = node.links
    return {
        "reach": links.reach,
        "p2p_addrs": links.p2p_addrs,
        "bytes_by_path": links.traffic.as_dict(),
        "impostor_records": node.directory.impostor_records,
        "impostor_calls": node.admission.interceptor.impostors,
        "replayed_tokens": links.verifier.replays,
        "cut_at_receive_deadline": node.servicer.cut_at_deadline,
        "libp2p_streams": {
            "in": links.bridge.streams_in if links.bridge else 0,
            "out": links.bridge.streams_out if links.bridge else 0,
            "refused_in": links.bridge.refused_in if links.bridge else 0,
        },
        "relay_served": links.relay.stats() if links.relay is not None else None,
    }


def _integrity_stats(node: Node) -> dict:
    """Steps skipped, weights repaired and payloads refused for not being finite."""
    w = node.worker
    return {
        "skipped_steps": w.inner.skipped_steps,
        "weights_repaired": w.repairs,
        "dropped_non_finite": w.dropped_non_finite,
        "payloads_refused": node.servicer.rejected.get("poisoned", 0),
    }


def _outer_stats(node: Node) -> dict:
    """The outer sync's counters, history and bytes, and the round a node that takes rounds is at."""
    out = {}
    if node.traits.syncs:
        counters = node.sync.counters
        out["outer"] = {k: v for k, v in vars(counters).items() if k != "history"}
        out["outer_history"] = counters.history
        out["bytes_sent_outer"] = node.sync.bytes_sent
        out["outer_bytes_per_round"] = round_bytes(counters.history)
    if node.traits.outer_rounds:
        out["outer_round"] = node.outer_round
        out["fetched_state"] = node.fetched_state
    return out


def _driver_stats(node: Node) -> dict:
    """The stage-0 driver's microbatches, losses and schedule (empty on other stages)."""
    if node.driver is not None:
        driver_log = node.driver.log
        return {
            "microbatches": node.driver.counters.as_dict(),
            "losses": driver_log.losses,
            "lrs": driver_log.lrs,
            "step_times": driver_log.step_times,
            "step_losses": driver_log.step_losses,
            "reissued_sequences": driver_log.reissued_sequences,
            "schedule": {
                "overlap": node.driver.overlap,
                "stale_microbatches": driver_log.stale_microbatches,
                "max_staleness": driver_log.max_staleness,
            },
        }
    if node.stage_index == 0 and (node.resumed_from or {}).get("microbatches"):
        # Restarted at its last step, this incarnation had nothing left to train: its predecessor's
        # accounting (from the checkpoint) is the driver's whole story.
        return {"microbatches": dict(node.resumed_from["microbatches"])}
    return {}


def training_snapshot(stats: dict) -> Snapshot:
    """The numbers a step line and the summary need, from `node_stats`."""
    losses = stats.get("step_losses") or []
    lrs = stats.get("lrs") or []
    outer, history = stats.get("outer"), stats.get("outer_history") or []
    microbatches = stats.get("microbatches") if "losses" in stats else None
    return Snapshot(
        stage=stats["stage"],
        step=stats["inner_steps"],
        tokens=stats["tokens"],
        lr=lrs[-1] if lrs else (stats["last_lr"] or None),
        loss=losses[-1] if losses else None,
        first_loss=losses[0] if losses else None,
        in_flight=stats["in_flight"],
        served=sum(stats["forwards_received"].values()),
        outer=outer,
        last_round=history[-1] if history else None,
        bytes_sent=stats["bytes_sent"] + stats.get("bytes_sent_outer", 0),
        bytes_received=stats["bytes_received"],
        dropped=microbatches["dropped"] if microbatches else stats["dropped_here"],
        issued=microbatches["issued"] if microbatches else None,
        attention=tuple(stats.get("attention") or ()),
        round_bytes=stats.get("outer_bytes_per_round"),
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
        outer_round_bytes=round_bytes(node.sync.counters.history if node.traits.syncs else [])["last"],
        loss=last_loss(node),
        attention=node_attention(node),
        **node.meter.record_fields(),
    )


def last_loss(node: Node) -> float | None:
    """Stage 0's last microbatch loss, when there is one and it is a number a record may carry."""
    losses = node.driver.log.losses if node.driver is not None else []
    loss = float(losses[-1]) if losses else None
    return loss if loss is not None and math.isfinite(loss) and 0.0 <= loss <= 1e6 else None


def round_bytes(history: list[dict]) -> dict[str, float]:
    """A snapshot's payload bytes (one way) in the node's outer rounds: the last and the mean, and
    the mean share of fp32 phi + Delta they were."""
    sizes = [sum(h["bytes"].values()) for h in history if isinstance(h.get("bytes"), dict)]
    fractions = [h["fp32_fraction"] for h in history if "fp32_fraction" in h]
    return {
        "last": int(sizes[-1]) if sizes else 0,
        "mean": sum(sizes) / len(sizes) if sizes else 0.0,
        "fp32_fraction": sum(fractions) / len(fractions) if fractions else 0.0,
    }


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
            done=node.done_at_step is not None,
        )
    )
