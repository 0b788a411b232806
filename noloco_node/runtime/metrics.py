"""Prometheus metrics of a node on its own registry and HTTP port.

Most values are read from the node's stats at scrape time (a custom collector), so the hot paths
pay nothing; RPC latency is the one histogram observed as calls complete.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _StatsCollector:
    def __init__(self, stats: Callable[[], dict], labels: dict[str, str]) -> None:
        self.stats, self.labels = stats, labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        s = self.stats()
        yield self._gauge("noloco_inner_step", "Inner steps taken", s["inner_steps"])
        yield self._gauge("noloco_tokens_per_second", "Tokens per second since start", s.get("tokens_per_s", 0.0))
        yield self._counter("noloco_tokens", "Tokens this stage computed backward for", s["tokens"])
        losses = s.get("losses") or []
        if losses:
            yield self._gauge("noloco_loss", "Loss of the last completed microbatch (stage 0)", losses[-1])
        yield self._gauge("noloco_in_flight", "Microbatches in this node's in-flight window", s["in_flight"])
        yield self._gauge("noloco_saved_inputs", "Saved forward inputs held for backward", s["saved_inputs"])
        yield self._counter("noloco_bans", "Peers banned after failed calls", s["bans"])
        yield self._counter("noloco_busy_answers", "Forwards refused because the window was full", s["busy_answers"])
        admission = s.get("admission")
        if admission is not None:
            refused = CounterMetricFamily("noloco_calls_refused", "Calls refused before any servicer ran, per status code",
                                          labels=[*self.labels, "code"])
            for code, count in sorted(admission["refused"].items()):
                refused.add_metric([*self.labels.values(), code], count)
            yield refused
            yield self._counter("noloco_peers_banned", "Peers banned for repeated invalid messages", admission["peers_banned"])
            yield self._gauge("noloco_peers_banned_now", "Peers under a ban now", admission["banned_now"])
        sent = CounterMetricFamily("noloco_bytes_sent", "Payload bytes sent, per service", labels=[*self.labels, "service"])
        sent.add_metric([*self.labels.values(), "stage"], s["bytes_sent"])
        sent.add_metric([*self.labels.values(), "outer"], s.get("bytes_sent_outer", 0))
        yield sent
        received = CounterMetricFamily("noloco_bytes_received", "Payload bytes received, per service",
                                       labels=[*self.labels, "service"])
        received.add_metric([*self.labels.values(), "stage"], s.get("bytes_received", 0))
        yield received
        outer = s.get("outer")
        if outer is not None:
            yield self._gauge("noloco_outer_round", "Outer rounds taken", outer["rounds"])
            outcomes = CounterMetricFamily("noloco_outer_outcomes", "Outer-round outcomes", labels=[*self.labels, "outcome"])
            for outcome in ("paired", "solo", "rejected", "timed_out"):
                outcomes.add_metric([*self.labels.values(), outcome], outer[outcome])
            yield outcomes


class NodeMetrics:
    def __init__(self, stats: Callable[[], dict], *, peer_id: str, stage: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"peer": peer_id[-8:], "stage": str(stage)}
        self.registry.register(_StatsCollector(stats, labels))
        self.rpc_latency = Histogram("noloco_rpc_latency_seconds", "Client-side latency of Stage calls", ["method"],
                                     registry=self.registry, buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))
        self.server = None

    def observe_rpc(self, method: str, seconds: float) -> None:
        self.rpc_latency.labels(method).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; returns the bound port."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
