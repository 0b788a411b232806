"""A node's admission pieces, built from `[security]`: the swarm key, the per-peer guard and the
interceptor in front of its gRPC services (which proves callers through the node's links)."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.config import ConfigError, SecurityConfig
from noloco_node.rpc.admission import AdmissionInterceptor, SwarmKeyError, load_swarm_key
from noloco_node.rpc.guard import GuardLimits, PeerGuard
from noloco_node.runtime.node_stats import AdmissionStats


@dataclass
class Admission:
    key: bytes | None
    guard: PeerGuard
    interceptor: AdmissionInterceptor

    def stats_view(self) -> AdmissionStats:
        """Calls refused before any servicer ran, and the guard's bans and limits."""
        guard = self.guard
        return AdmissionStats(
            swarm_key=self.key is not None,
            refused=dict(self.interceptor.refused),
            peers_banned=guard.stats.bans,
            banned_now=guard.banned(),
            rate_limited=guard.stats.rate_limited,
            over_stream_cap=guard.stats.over_stream_cap,
            refused_banned=guard.stats.refused_banned,
            tracked_peers=guard.tracked(),
        )


def read_swarm_key(cfg: SecurityConfig) -> bytes | None:
    if cfg.swarm_key_file is None:
        return None
    try:
        return load_swarm_key(cfg.swarm_key_file)
    except SwarmKeyError as exc:
        raise ConfigError(
            "security.swarm_key_file", str(exc), "give every peer the same file from `noloco-node keygen`"
        ) from None


def build_admission(cfg: SecurityConfig, links) -> Admission:
    """`links` (transport.links.Links) verifies call tokens and names the libp2p peer behind a
    bridged connection."""
    key = read_swarm_key(cfg)
    limits = GuardLimits(
        requests_per_s=cfg.peer_requests_per_s,
        burst=cfg.peer_burst,
        max_streams=cfg.peer_max_streams,
        ban_after_invalid=cfg.ban_after_invalid,
        ban_s=cfg.ban_s,
        ban_max_s=cfg.ban_max_s,
        ban_after_poisoned=cfg.ban_after_poisoned,
    )
    guard = PeerGuard(limits)
    return Admission(
        key, guard, AdmissionInterceptor(verifier=links.verifier, swarm_key=key, guard=guard, bridged=links.origin)
    )
