"""What a node writes about itself: its stats (for the stats file, /metrics, experiments) and,
on request, its weights. `self` is the Node; kept apart so the lifecycle stays small."""

from __future__ import annotations

import json
from pathlib import Path

from noloco_node.sync.transfer import counters_json, export_state
from noloco_node.runtime.files import atomic_write_text


def node_stats(self) -> dict:
    """Everything a node reports about itself: the stats file, /metrics and experiments read it."""
    s = self.runtime.stats
    out = {"peer_id": self.peer_id, "stage": self.stage_index, "address": self.address,
           "inner_steps": self.worker.inner_steps, "sequences": self.worker.sequences_total,
           "tokens": self.worker.tokens_total, "forwards_received": dict(s.forwards_received),
           "forwards_sent": s.forwards_sent, "backwards_sent": s.backwards_sent, "send_failures": s.send_failures,
           "dropped_here": s.dropped_here, "expired": s.expired, "busy_answers": s.busy_answers,
           "routed": {"balanced": s.routed_balanced, "random": s.routed_random}, "routed_to": dict(s.routed_to),
           "routed_by_capacity": dict(self.runtime.router.measured_picks),
           "routed_expected": {p: round(v, 3) for p, v in self.runtime.router.measured_shares.items()},
           "throughput": self.meter.record_fields(),
           "bytes_sent": self.client.bytes_sent, "rejected": dict(self.servicer.rejected),
           "saved_inputs": len(self.worker.saved), "bans": self.bans.total,
           "in_flight": len(self.runtime.in_flight), "bytes_received": self.servicer.bytes_received,
           "tokens_per_s": self.tokens_per_s}
    guard = self.admission.guard
    out["admission"] = {"swarm_key": self.admission.key is not None, "refused": dict(self.admission.interceptor.refused),
                        "peers_banned": guard.stats.bans, "banned_now": guard.banned(),
                        "rate_limited": guard.stats.rate_limited, "over_stream_cap": guard.stats.over_stream_cap,
                        "refused_banned": guard.stats.refused_banned, "tracked_peers": guard.tracked()}
    links = self.links
    out["transport"] = {"reach": links.reach, "p2p_addrs": links.p2p_addrs, "bytes_by_path": links.traffic.as_dict(),
                        "impostor_records": self.directory.impostor_records,
                        "impostor_calls": self.admission.interceptor.impostors, "replayed_tokens": links.verifier.replays,
                        "cut_at_receive_deadline": self.servicer.cut_at_deadline,
                        "libp2p_streams": {"in": links.bridge.streams_in if links.bridge else 0,
                                           "out": links.bridge.streams_out if links.bridge else 0,
                                           "refused_in": links.bridge.refused_in if links.bridge else 0},
                        "relay_served": links.relay.stats() if links.relay is not None else None}
    w = self.worker
    out["integrity"] = {"skipped_steps": w.inner.skipped_steps, "weights_repaired": w.repairs,
                        "dropped_non_finite": w.dropped_non_finite, "payloads_refused": self.servicer.rejected.get("poisoned", 0)}
    out["routing_bans"] = self.bans.banned_peers()
    out["faults_fired"] = [f"{point}:{action}" for point, action in self.faults.fired]
    counters = self.sync.counters if self.sync is not None else (self.dp_step.counters if self.dp_step else None)
    if counters is not None:
        out["outer"] = {k: v for k, v in vars(counters).items() if k != "history"}
        out["outer_history"] = counters.history
        out["bytes_sent_outer"] = self.outer_bytes_sent()
    if self.sync is not None:
        out["outer_round"] = self.outer_round
        out["fetched_state"] = self.fetched_state
    out["resumed_from"] = self.resumed_from
    out["movable"] = self.movable
    out["moves"] = self.moves  # each: from, to, at, inner_step, and the stage-0 driver's microbatches before it
    if self.driver is not None:
        c = self.driver.counters
        out["microbatches"] = {"issued": c.issued, "completed": c.completed, "reissued": c.reissued, "dropped": c.dropped}
        out["losses"] = self.driver.log.losses
        out["lrs"] = self.driver.log.lrs
        out["step_times"] = self.driver.log.step_times
        out["step_losses"] = self.driver.log.step_losses
        out["reissued_sequences"] = self.driver.log.reissued_sequences
        out["schedule"] = {"overlap": self.driver.overlap, "stale_microbatches": self.driver.log.stale_microbatches,
                           "max_staleness": self.driver.log.max_staleness}
    elif self.stage_index == 0 and (self.resumed_from or {}).get("microbatches"):
        # Restarted at its last step, this incarnation had nothing left to train: its predecessor's
        # accounting (from the checkpoint) is the driver's whole story.
        out["microbatches"] = dict(self.resumed_from["microbatches"])
    return out


def write_outputs(self, out_dir: Path) -> None:
    """The stats JSON (and, with save_weights, theta and the outer state) under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"stage{self.stage_index}-{self.peer_id[-8:]}"
    atomic_write_text(out_dir / f"{name}.json", json.dumps(self.stats(), indent=1))
    if self.save_weights:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in self.stage.state_dict().items()},
                  str(out_dir / f"{name}.safetensors"))
        if self.sync is not None:
            tensors, counters = export_state(self.outer_state, self.worker.inner, inner_step=self.worker.inner_steps)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"{name}.outer.safetensors"),
                      metadata={"counters": counters_json(counters)})


async def save_snapshot(self, inner_step: int, *, final: bool = False) -> None:
    """theta at `inner_step` as stage{s}-{peer}-step{k}.safetensors, or as ...-final.safetensors
    when training has ended (experiments evaluate them)."""
    import asyncio

    from safetensors.torch import save_file

    tensors = await self.compute.run(lambda: {n: p.detach().to("cpu", copy=True).contiguous()
                                              for n, p in self.stage.named_parameters()})
    self.snapshot_dir.mkdir(parents=True, exist_ok=True)
    name = f"stage{self.stage_index}-{self.peer_id[-8:]}-{'final' if final else f'step{inner_step}'}.safetensors"
    await asyncio.to_thread(save_file, tensors, str(self.snapshot_dir / name))
