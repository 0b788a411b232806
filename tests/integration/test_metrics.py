"""A running node's /metrics parses as Prometheus text and carries the node's metrics."""

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_metrics_endpoint(tmp_path, make_swarm):
    steps = 3
    overrides = tiny_overrides(
        tmp_path, **{"outer.method": "noloco", "outer.inner_steps_per_outer": 3, "timeouts.match_s": 1.0}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    server = swarm.start_node(1, 0, "--set", "network.metrics_port=0")
    swarm.wait_ready([server])
    driver = swarm.start_node(0, 0, "--steps", str(steps))
    swarm.wait_exit([driver], timeout_s=120)
    port = json.loads(server.ready_file.read_text())["metrics_port"]
    families = scrape(port)
    for name in (
        "noloco_inner_step",
        "noloco_tokens_per_second",
        "noloco_tokens",
        "noloco_in_flight",
        "noloco_saved_inputs",
        "noloco_bans",
        "noloco_bytes_sent",
        "noloco_bytes_received",
        "noloco_outer_round",
        "noloco_outer_outcomes",
        "noloco_rpc_latency_seconds",
    ):
        assert name in families, sorted(families)
    value = {f.name: f.samples[0].value for f in families.values() if f.samples}
    assert value["noloco_inner_step"] == steps
    assert value["noloco_saved_inputs"] == 0 and value["noloco_in_flight"] == 0
    latency = [
        s
        for s in families["noloco_rpc_latency_seconds"].samples
        if s.name.endswith("_count") and s.labels["method"] == "Backward"
    ]
    assert latency and latency[0].value == steps * 2  # one Backward per microbatch
    received = {s.labels["service"]: s.value for s in families["noloco_bytes_received"].samples}
    assert received["stage"] > 0
    # A loopback node is reached directly; its gradients went upstream over the direct TLS path.
    reach = {s.labels["reach"]: s.value for s in families["noloco_reach"].samples}
    assert reach == {"direct": 1.0, "holepunched": 0.0, "relayed": 0.0}
    by_path = {
        (s.labels["path"], s.labels["direction"]): s.value
        for s in families["noloco_path_bytes"].samples
        if s.name.endswith("_total")
    }
    assert by_path.get(("direct", "out"), 0) > 0, by_path
