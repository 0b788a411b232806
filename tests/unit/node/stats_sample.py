"""A small `NodeStats` for tests of its readers (the stats file, join's lines, the node page)."""

from __future__ import annotations

import dataclasses

from noloco_node.runtime.node_stats import (
    AdmissionStats,
    DriverStats,
    IntegrityStats,
    LinkStats,
    MicrobatchCounts,
    NodeStats,
    OuterCounts,
    OuterStats,
    TransportStats,
    WorkStats,
)

WORK = WorkStats(
    inner_steps=8,
    last_lr=5e-4,
    sequences=16,
    tokens=512,
    forwards_received={"p": 3, "q": 4},
    forwards_sent=5,
    backwards_sent=6,
    send_failures=0,
    dropped_here=2,
    expired=1,
    busy_answers=0,
    routed_balanced=4,
    routed_random=1,
    routed_to={"n": 5},
    routed_by_capacity={"n": 3},
    routed_expected={"n": 1.0},
    throughput={"capacity": 2.0},
    bytes_sent=1000,
    rejected={"poisoned": 1},
    saved_inputs=0,
    bans=0,
    in_flight=2,
    bytes_received=700,
)
OUTER = OuterStats(
    counts=OuterCounts(
        rounds=2,
        paired=1,
        solo=1,
        rejected=0,
        timed_out=0,
        skipped=0,
        resynced=0,
        mixed_rounds=0,
        partial_rounds=0,
    ),
    history=[
        {"round": 1, "outcome": "paired", "partner": "p1", "bytes": {"phi": 300, "delta": 100}, "fp32_fraction": 0.5},
        {"round": 2, "outcome": "solo", "partner": None},
    ],
    bytes_sent=500,
)
DRIVER = DriverStats(
    microbatches=MicrobatchCounts(issued=16, completed=15, reissued=0, dropped=1),
    losses=[7.0, 8.0],
    lrs=[1e-3, 2e-3],
    step_times=[0.5, 0.25],
    step_losses=[7.5, 6.25],
    logged_step=8,
    reissued_sequences=[],
    overlap=False,
    stale_microbatches=0,
    max_staleness=0,
)


def sample_stats(*, stage: int = 0, driver: bool = True, outer: bool = True, **fields) -> NodeStats:
    """Stage `stage`'s stats; `driver` and `outer` add the stage-0 driver's and the outer sync's."""
    stats = NodeStats(
        peer_id="me",
        stage=stage,
        address="127.0.0.1:1",
        work=WORK,
        tokens_per_s=12.5,
        attention=["note"],
        admission=AdmissionStats(
            swarm_key=False,
            refused={"UNAUTHENTICATED": 2},
            peers_banned=1,
            banned_now=0,
            rate_limited=3,
            over_stream_cap=0,
            refused_banned=0,
            tracked_peers=4,
        ),
        transport=TransportStats(
            links=LinkStats(
                reach="direct",
                p2p_addrs=[],
                bytes_by_path={"direct": {"out": 10}},
                replayed_tokens=0,
                streams_in=1,
                streams_out=2,
                streams_refused_in=0,
                relay_served=None,
            ),
            impostor_records=0,
            impostor_calls=0,
            cut_at_receive_deadline=0,
        ),
        integrity=IntegrityStats(skipped_steps=0, weights_repaired=0, dropped_non_finite=0, payloads_refused=1),
        routing_bans=[],
        faults_fired=[],
        outer=OUTER if outer else None,
        outer_round=2 if outer else None,
        moves=[],
        driver=DRIVER if driver else None,
    )
    return dataclasses.replace(stats, **fields)
