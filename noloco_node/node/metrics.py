"""Prometheus metrics of a node on its own registry and HTTP port.

Most values are read from the node's typed stats (runtime/node_stats.py) at scrape time (a custom
collector), so the hot paths pay nothing; RPC latency is the one histogram observed as calls complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from noloco_node.node.metrics_http import serve_metrics
from noloco_node.runtime.node_stats import AdmissionStats, IntegrityStats, NodeStats, OuterCounts, TransportStats


class _Labelled:
    """Metric families with this collector's labels."""

    labels: dict[str, str]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _relay(self, served: dict) -> Iterator[Metric]:
        """What a relay carried (a node's, or a bootstrap's)."""
        yield self._counter(
            "noloco_relay_bytes", "Bytes this node relayed between peers behind NAT", served["bytes_relayed"]
        )
        yield self._gauge(
            "noloco_relay_circuits_open", "Relay circuits open through this node", served["circuits_open"]
        )


class _StatsCollector(_Labelled):
    def __init__(self, stats: Callable[[], NodeStats], labels: dict[str, str]) -> None:
        self.stats, self.labels = stats, labels

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield from self._work(s)
        yield from self._integrity(s.integrity)
        yield from self._transport(s.transport)
        yield from self._admission(s.admission)
        yield from self._payload_bytes(s)
        if s.outer is not None:
            yield from self._outer(s.outer.counts)

    def _work(self, s: NodeStats) -> Iterator[Metric]:
        """Steps, tokens, loss and the in-flight window of the stage."""
        work = s.work
        yield self._gauge("noloco_inner_step", "Inner steps taken", work.inner_steps)
        yield self._gauge("noloco_tokens_per_second", "Tokens per second over the last minute", s.tokens_per_s)
        yield self._counter("noloco_tokens", "Tokens this stage computed backward for", work.tokens)
        if s.loss is not None:
            yield self._gauge("noloco_loss", "Loss of the last completed microbatch (stage 0)", s.loss)
        yield self._gauge("noloco_in_flight", "Microbatches in this node's in-flight window", work.in_flight)
        yield self._gauge("noloco_saved_inputs", "Saved forward inputs held for backward", work.saved_inputs)
        yield self._counter("noloco_bans", "Peers banned after failed calls", work.bans)
        yield self._counter("noloco_busy_answers", "Forwards refused because the window was full", work.busy_answers)

    def _integrity(self, integrity: IntegrityStats) -> Iterator[Metric]:
        """Steps skipped, weights repaired and payloads refused for not being finite."""
        yield self._counter(
            "noloco_inner_steps_skipped",
            "Inner steps skipped: their gradients were not finite",
            integrity.skipped_steps,
        )
        yield self._counter(
            "noloco_weights_repaired",
            "Times this stage's weights went non-finite and were restored",
            integrity.weights_repaired,
        )
        yield self._counter(
            "noloco_payloads_refused",
            "Received tensors refused: non-finite or outside the running bounds",
            integrity.payloads_refused,
        )

    def _transport(self, transport: TransportStats) -> Iterator[Metric]:
        """Bytes per path, how peers reach the node, what the transport refused, and what it relayed."""
        links = transport.links
        by_path = CounterMetricFamily(
            "noloco_path_bytes",
            "Bytes per transport path (direct: TLS gRPC payload sent; "
            "holepunched / relayed: bytes carried over libp2p streams)",
            labels=[*self.labels, "path", "direction"],
        )
        for path, directions in links.bytes_by_path.items():
            for direction, n in directions.items():
                by_path.add_metric([*self.labels.values(), path, direction], n)
        yield by_path
        reach = GaugeMetricFamily(
            "noloco_reach", "How peers reach this node (1 on the current path)", labels=[*self.labels, "reach"]
        )
        for name in ("direct", "holepunched", "relayed"):
            reach.add_metric([*self.labels.values(), name], 1.0 if links.reach == name else 0.0)
        yield reach
        yield self._counter(
            "noloco_impostor_records",
            "DHT records refused: they claim another node's peer id",
            transport.impostor_records,
        )
        yield self._counter("noloco_replayed_tokens", "Calls refused as replays of a used token", links.replayed_tokens)
        yield self._counter(
            "noloco_streams_cut", "Streams cut at this node's receive deadline", transport.cut_at_receive_deadline
        )
        if links.relay_served is not None:
            yield from self._relay(links.relay_served)

    def _admission(self, admission: AdmissionStats) -> Iterator[Metric]:
        """Calls refused before any servicer ran, and the peers banned."""
        refused = CounterMetricFamily(
            "noloco_calls_refused",
            "Calls refused before any servicer ran, per status code",
            labels=[*self.labels, "code"],
        )
        for code, count in sorted(admission.refused.items()):
            refused.add_metric([*self.labels.values(), code], count)
        yield refused
        yield self._counter("noloco_peers_banned", "Peers banned for repeated invalid messages", admission.peers_banned)
        yield self._gauge("noloco_peers_banned_now", "Peers under a ban now", admission.banned_now)

    def _payload_bytes(self, s: NodeStats) -> Iterator[Metric]:
        """Payload bytes sent and received, per service."""
        sent = CounterMetricFamily(
            "noloco_bytes_sent", "Payload bytes sent, per service", labels=[*self.labels, "service"]
        )
        sent.add_metric([*self.labels.values(), "stage"], s.work.bytes_sent)
        sent.add_metric([*self.labels.values(), "outer"], s.outer.bytes_sent if s.outer is not None else 0)
        yield sent
        received = CounterMetricFamily(
            "noloco_bytes_received", "Payload bytes received, per service", labels=[*self.labels, "service"]
        )
        received.add_metric([*self.labels.values(), "stage"], s.work.bytes_received)
        yield received

    def _outer(self, counts: OuterCounts) -> Iterator[Metric]:
        """Outer rounds taken and their outcomes."""
        yield self._gauge("noloco_outer_round", "Outer rounds taken", counts.rounds)
        outcomes = CounterMetricFamily(
            "noloco_outer_outcomes", "Outer-round outcomes", labels=[*self.labels, "outcome"]
        )
        for outcome in ("paired", "solo", "rejected", "timed_out"):
            outcomes.add_metric([*self.labels.values(), outcome], getattr(counts, outcome))
        yield outcomes


class _MetricsServer:
    """/metrics over one registry on its own HTTP port."""

    registry: CollectorRegistry
    server = None

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server (node/metrics_http.py: bounded against idle and slow
        clients); returns the bound port."""
        self.server = serve_metrics(self.registry, host, port)
        return self.server.server_port

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class NodeMetrics(_MetricsServer):
    def __init__(self, stats: Callable[[], NodeStats], *, peer_id: str, stage: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"peer": peer_id[-8:], "stage": str(stage)}
        self.registry.register(_StatsCollector(stats, labels))
        self.rpc_latency = Histogram(
            "noloco_rpc_latency_seconds",
            "Client-side latency of Stage calls",
            ["method"],
            registry=self.registry,
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
        )

    def observe_rpc(self, method: str, seconds: float) -> None:
        self.rpc_latency.labels(method).observe(seconds)


class _RelayCollector(_Labelled):
    """A bootstrap's relay counters, read from the relay at scrape time."""

    def __init__(self, relay_stats: Callable[[], dict | None], labels: dict[str, str]) -> None:
        self.relay_stats, self.labels = relay_stats, labels

    def collect(self) -> Iterator[Metric]:
        served = self.relay_stats()
        if served is not None:
            yield from self._relay(served)


class BootstrapMetrics(_MetricsServer):
    """A bootstrap's /metrics: what its relay carried (the same names a node's relay counters have)."""

    def __init__(self, relay_stats: Callable[[], dict | None], *, peer_id: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RelayCollector(relay_stats, {"peer": peer_id[-8:], "role": "bootstrap"}))
