"""/metrics is bounded against clients that never finish their request. Found by a hostile-peer
audit: prometheus_client's start_http_server starts a thread per connection and waits for the
headers forever, and half-sent requests took a node from 19 to 640 threads."""

import http.client
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from noloco_node.node.metrics_http import serve_metrics

TIMEOUT_S, CAP = 0.5, 8


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Counter("noloco_test_scrapes", "A counter to find in the scrape", registry=registry).inc()
    httpd = serve_metrics(registry, "127.0.0.1", 0, request_timeout_s=TIMEOUT_S, max_connections=CAP)
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def half_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
    return sock


def closed_after(sock: socket.socket, limit_s: float = 5.0) -> float:
    """Seconds until the server closes `sock` (it sends nothing first)."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    assert sock.recv(1) == b""
    return time.monotonic() - start


def test_a_half_sent_request_is_dropped_after_the_timeout(server):
    sock = half_request(server.server_port)
    with sock:
        assert TIMEOUT_S * 0.8 < closed_after(sock) < TIMEOUT_S + 1.0


def test_a_trickled_request_is_dropped_at_the_same_deadline(server):
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as sock:
        start = time.monotonic()
        try:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            pass  # the server closed it under us
        sock.settimeout(5)
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - start < TIMEOUT_S + 1.5  # not the 5.5 s the trickle would take


def scrape_from(port: int, source: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def test_metrics_are_served_while_idle_connections_are_open(server):
    idle = [half_request(server.server_port) for _ in range(CAP // 2 - 1)]
    try:
        time.sleep(0.1)
        start = time.monotonic()
        assert "noloco_test_scrapes_total 1.0" in scrape(server.server_port)
        assert time.monotonic() - start < TIMEOUT_S
    finally:
        for sock in idle:
            sock.close()


def test_one_host_holding_its_share_does_not_keep_another_host_out(server):
    idle = [half_request(server.server_port) for _ in range(3 * CAP)]  # all from 127.0.0.1
    try:
        time.sleep(0.1)
        start = time.monotonic()
        assert "noloco_test_scrapes_total 1.0" in scrape_from(server.server_port, "127.0.0.2")
        assert time.monotonic() - start < TIMEOUT_S
    finally:
        for sock in idle:
            sock.close()


def settled(count, at_most: int, limit_s: float = 3.0) -> int:
    """`count()`, waited for (bounded) to fall to `at_most`: a handler thread gives its place back
    just after it closed its socket, and ends just after that."""
    deadline = time.monotonic() + limit_s
    while count() > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
    return count()


def handler_threads(besides: set[threading.Thread]) -> int:
    """Connection threads alive now that were not in `besides` (other tests' servers may linger)."""
    return sum(1 for t in threading.enumerate() if t not in besides and "process_request_thread" in t.name)


def test_connections_over_the_cap_get_no_thread_and_service_resumes():
    registry = CollectorRegistry()
    Counter("noloco_test_scrapes", "A counter to find in the scrape", registry=registry).inc()
    httpd = serve_metrics(registry, "127.0.0.1", 0, request_timeout_s=1.5, max_connections=CAP)
    before = set(threading.enumerate())
    idle = [half_request(httpd.server_port) for _ in range(5 * CAP)]
    try:
        deadline = time.monotonic() + 3.0  # every connection accepted: served or refused
        while httpd.refused + httpd.serving < len(idle) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpd.serving == CAP // 2  # one host: half the places, the rest closed unserved
        assert handler_threads(before) == CAP // 2
        assert httpd.refused >= 4 * CAP
        assert closed_after(idle[-1], 1.0) < 1.0  # over the cap: closed at once
        for sock in idle[: CAP // 2]:  # those served are cut at the deadline, freeing their places
            closed_after(sock)
        assert settled(lambda: httpd.serving, 0) == 0
        assert "noloco_test_scrapes_total 1.0" in scrape(httpd.server_port)
        assert settled(lambda: httpd.serving, 0) == 0
        assert settled(lambda: handler_threads(before), 0) == 0
    finally:
        for sock in idle:
            sock.close()
        httpd.shutdown()
        httpd.server_close()
