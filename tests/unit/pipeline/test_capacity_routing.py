"""Measured throughput and capacity-proportional routing (runtime/throughput.py, router.py)."""

import random
from collections import Counter

import pytest

from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.router import RELAYED_WEIGHT, Bans, Router
from noloco_node.runtime.throughput import ThroughputMeter, limiting_stage, routing_weights


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_meter_measures_capacity_per_compute_second_and_throughput_per_wall_second():
    clock = Clock()
    meter = ThroughputMeter(alpha=1.0, clock=clock)
    assert meter.record_fields() == {"capacity": 0.0, "throughput": 0.0, "busy": 0.0, "hop_s": 0.0, "link_mbit_s": 0.0}
    # The first sample already measures, from the meter's creation: 2 s of wall time, 0.5 s of it
    # computing 10 sequences, 4 of 8 slots in use.
    clock.now = 2.0
    meter.sample(sequences=10, busy_s=0.5, in_flight=4, window=8)
    meter.observe_hop(0.02)
    assert meter.record_fields() == {
        "capacity": 20.0,
        "throughput": 5.0,
        "busy": 0.5,
        "hop_s": 0.02,
        "link_mbit_s": 0.0,
    }


def test_meter_smooths_and_keeps_capacity_through_idle_windows():
    clock = Clock()
    meter = ThroughputMeter(alpha=0.5, clock=clock)
    clock.now = 1.0
    meter.sample(sequences=10, busy_s=1.0, in_flight=8, window=8)
    clock.now = 2.0
    meter.sample(sequences=10, busy_s=1.0, in_flight=0, window=8)  # idle: nothing computed
    fields = meter.record_fields()
    assert fields["capacity"] == 10.0  # unchanged: an idle window says nothing about speed
    assert fields["throughput"] == 5.0 and fields["busy"] == 0.5


def test_unmeasured_replicas_weigh_the_mean_and_all_unknown_is_uniform():
    assert routing_weights([0.0, 0.0]) == [1.0, 1.0]
    assert routing_weights([30.0, 0.0, 10.0]) == [30.0, 20.0, 10.0]


def test_limiting_stage_is_the_one_with_least_total_capacity():
    assert limiting_stage({0: [10.0, 10.0], 1: [12.0]}) == 1
    assert limiting_stage({0: [10.0], 1: [0.0]}) is None  # not measured yet
    assert limiting_stage({}) is None


@pytest.mark.parametrize("relayed", [False, True])
def test_capacity_routing_draws_in_proportion_to_capacity(relayed):
    router = Router(Bans(), random.Random(0), by_capacity=True)
    peers = [Peer("fast", "a:1", capacity=30.0), Peer("slow", "b:1", "relayed" if relayed else "direct", capacity=10.0)]
    counts = Counter(router.pick(peers).peer_id for _ in range(20_000))
    slow = 10.0 * (RELAYED_WEIGHT if relayed else 1.0)
    assert counts["slow"] / 20_000 == pytest.approx(slow / (30.0 + slow), abs=0.01)
    assert router.measured_picks == counts  # every pick had both capacities measured
    assert router.measured_shares["slow"] == pytest.approx(20_000 * slow / (30.0 + slow))


def test_capacity_routing_skips_banned_and_excluded_peers():
    bans = Bans()
    router = Router(bans, random.Random(1), by_capacity=True)
    peers = [Peer("a", "a:1", capacity=5.0), Peer("b", "b:1", capacity=50.0), Peer("c", "c:1", capacity=5.0)]
    bans.ban("b")
    picked = {router.pick(peers, exclude={"c"}).peer_id for _ in range(200)}
    assert picked == {"a"}


def test_random_routing_keeps_equal_shares_whatever_the_capacity():
    router = Router(Bans(), random.Random(2))
    peers = [Peer("fast", "a:1", capacity=30.0), Peer("slow", "b:1", capacity=10.0)]
    counts = Counter(router.pick(peers).peer_id for _ in range(1000))
    assert counts == {"fast": 500, "slow": 500}


def test_stage_auto_joins_the_stage_that_sustains_the_least():
    from noloco_node.runtime.throughput import weakest_stage

    assert weakest_stage([[50.0, 50.0], []]) == 1  # an empty stage first
    assert weakest_stage([[50.0, 50.0], [30.0]]) == 1  # 30 < 100, though both have replicas
    assert weakest_stage([[20.0, 20.0, 20.0], [70.0]]) == 0  # three slow replicas sustain less than one fast
    assert weakest_stage([[20.0, 0.0], [70.0]]) == 1  # one not measured yet: fewest replicas
    assert weakest_stage([[10.0], [10.0]]) == 0  # ties: the lowest index


def test_capacities_within_the_spread_keep_the_equal_shares_of_the_cycle():
    router = Router(Bans(), random.Random(3), by_capacity=True)
    peers = [Peer("a", "a:1", capacity=100.0), Peer("b", "b:1", capacity=80.0)]  # 1.25x apart: noise
    counts = Counter(router.pick(peers).peer_id for _ in range(1000))
    assert counts == {"a": 500, "b": 500} and not router.measured_picks
