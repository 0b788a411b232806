"""/metrics over HTTP: prometheus_client's WSGI app on a wsgiref server bounded against clients
that connect and never finish their request.

prometheus_client's own start_http_server starts one OS thread per connection and waits for a
request's headers forever: a hostile-peer audit took a node from 19 to 640 threads with half-sent
requests. Here a connection has `request_timeout_s` in all to send its request (a request trickled
a byte at a time is cut at the same deadline), and at most `max_connections` are served at once,
at most half of them from one host: one over either cap is closed as soon as it is accepted,
without a thread, so one host holding its half cannot keep a scraper on another host out.
Scrapes are one short GET, so none of these bounds touches Prometheus.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
"""How long a connection may take to send its whole request (and each write of the answer)."""
MAX_CONNECTIONS = 16
"""Connections served at once (one thread each), at most half of them per host; more are closed at once."""


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, every read waiting only for what is left of one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    """One request per connection (wsgiref's), read against the server's request deadline."""

    server: BoundedWSGIServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # every socket operation, the answer's writes too
        super().setup()
        deadline = time.monotonic() + self.server.request_timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the headers are in: the answer gets the usual timeout
        self.connection.settimeout(self.server.request_timeout_s)
        return parsed

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """Log nothing: a scrape every few seconds is not news."""


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """wsgiref's server, one daemon thread per connection, at most `max_connections` of them."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address, handler, *, request_timeout_s: float, max_connections: int) -> None:
        self.request_timeout_s = request_timeout_s
        self.max_connections, self.max_per_host = max_connections, max(1, max_connections // 2)
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.refused = 0
        self.cut = 0
        super().__init__(address, handler)

    @property
    def serving(self) -> int:
        """Connections being served now, each holding one thread."""
        with self._lock:
            return sum(self._open.values())

    def _take(self, host: str) -> bool:
        with self._lock:
            if sum(self._open.values()) >= self.max_connections or self._open.get(host, 0) >= self.max_per_host:
                return False
            self._open[host] = self._open.get(host, 0) + 1
            return True

    def _give_back(self, host: str) -> None:
        with self._lock:
            self._open[host] -= 1
            if not self._open[host]:
                del self._open[host]

    def process_request(self, request, client_address) -> None:
        if not self._take(client_address[0]):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back(client_address[0])
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(client_address[0])

    def handle_error(self, request, client_address) -> None:
        """A client that timed out or hung up is counted, not printed with a traceback."""
        self.cut += 1
        log.debug("metrics request from %s cut", client_address, exc_info=True)


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> BoundedWSGIServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread; the server's
    `server_port` is the bound port, `shutdown()` and `server_close()` stop it."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(BoundedWSGIServer):
        address_family = family

    def server(address, handler):
        return Server(address, handler, request_timeout_s=request_timeout_s, max_connections=max_connections)

    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
