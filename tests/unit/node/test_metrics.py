"""/metrics as Prometheus scrapes it: a node's relay counters, and a bootstrap's, under the same
names (operator.md lists them with the `_total` Prometheus gives every counter)."""

import dataclasses
import urllib.request

from prometheus_client import generate_latest

from noloco_node.node.metrics import BootstrapMetrics, NodeMetrics
from tests.unit.node.stats_sample import sample_stats

SERVED = {"bytes_relayed": 1234, "circuits_open": 3}


def test_a_nodes_metrics_carry_its_relay_counters_when_it_relays():
    stats = sample_stats()
    links = dataclasses.replace(stats.transport.links, relay_served=SERVED)
    relaying = dataclasses.replace(stats, transport=dataclasses.replace(stats.transport, links=links))
    quiet = generate_latest(NodeMetrics(lambda: stats, peer_id="QmPeer12345678", stage=0).registry).decode()
    text = generate_latest(NodeMetrics(lambda: relaying, peer_id="QmPeer12345678", stage=0).registry).decode()
    assert "noloco_relay_bytes_total" not in quiet
    assert 'noloco_relay_bytes_total{peer="12345678",stage="0"} 1234.0' in text
    assert "noloco_inner_steps_skipped_total" in text and "noloco_payloads_refused_total" in text


def test_a_bootstrap_serves_its_relay_counters_over_http():
    served: list[dict | None] = [None]
    metrics = BootstrapMetrics(lambda: served[0], peer_id="QmBoot12345678")
    port = metrics.serve("127.0.0.1", 0)
    try:

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()

        assert "noloco_relay" not in scrape()  # no relay serving yet
        served[0] = SERVED
        text = scrape()
    finally:
        metrics.stop()
    assert 'noloco_relay_bytes_total{peer="12345678",role="bootstrap"} 1234.0' in text
    assert 'noloco_relay_circuits_open{peer="12345678",role="bootstrap"} 3.0' in text
