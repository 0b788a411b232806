"""The dashboard's HTTP server: aiohttp on the process's own event loop, read-only.

Pages are static files (no build step, uPlot vendored: they work offline); the JSON comes from
callables the owner passes in, each awaited per request. Only GET and HEAD are routed: any other
method is 405 and any other path 404, so nothing here can change the node. Pages and JSON carry a
Content-Security-Policy that allows only this origin's own scripts and styles: a string a peer
put in its record is text on the page, never markup or script. A connection that sends no whole
request within IDLE_TIMEOUT_S (a half-sent one included, however slowly it trickles in) is closed:
aiohttp's default (3630 s in 3.14) kept one for an hour.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources

from aiohttp import web


def page_url(host: str, port: int) -> str:
    """The address to open for a page served on `host`: a wildcard bind is opened on this machine."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"


STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'; form-action 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
JsonSource = Callable[[], Awaitable[Mapping]]
IDLE_TIMEOUT_S = 15.0
"""How long a connection may go without a whole request: a page polls every 2 s."""


def _static_file(name: str) -> bytes:
    return resources.files("noloco_node.dashboard").joinpath("static", *name.split("/")).read_bytes()


class DashboardServer:
    """Serves `pages` ({path: static file name}) and `api` ({path: async callable -> JSON}) on
    host:port; `start()` returns the bound port (0 = any free one)."""

    def __init__(
        self, *, pages: Mapping[str, str], api: Mapping[str, JsonSource], idle_timeout_s: float = IDLE_TIMEOUT_S
    ) -> None:
        self.pages, self.api, self.idle_timeout_s = dict(pages), dict(api), idle_timeout_s
        self._runner: web.AppRunner | None = None
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._headers])
        for path, name in self.pages.items():
            app.router.add_get(path, self._page(name))
        for path, source in self.api.items():
            app.router.add_get(path, self._json(source))
        app.router.add_get("/static/{name:[A-Za-z0-9_./-]+}", self._static)
        return app

    async def start(self, host: str, port: int) -> int:
        # access_log=None: a page polling every 2 s would otherwise log every request at INFO.
        # keepalive_timeout: aiohttp closes a connection with no whole request after it, counted
        # from the connection's start or its last answer (partial data does not restart it).
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout_s
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        return self._runner.addresses[0][1]  # the caller says where to look, once

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _headers(self, request: web.Request, handler) -> web.StreamResponse:
        self.requests += 1
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # 404 and 405 leave with the same headers
            response = exc
        response.headers.update(SECURITY_HEADERS)
        if isinstance(response, web.HTTPException):
            raise response
        return response

    def _page(self, name: str):
        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=_static_file(name), content_type="text/html", charset="utf-8")

        return handle

    def _json(self, source: JsonSource):
        async def handle(request: web.Request) -> web.Response:
            body = json.dumps(finite(await source()), allow_nan=False, default=_plain)
            # Others build on the JSON (docs/dashboard.md): any origin may read it; nothing writes.
            return web.Response(
                text=body, content_type="application/json", headers={"Access-Control-Allow-Origin": "*"}
            )

        return handle

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        suffix = name[name.rfind(".") :] if "." in name else ""
        if ".." in name.split("/") or suffix not in STATIC_TYPES:
            raise web.HTTPNotFound()
        try:
            body = _static_file(name)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise web.HTTPNotFound() from None
        return web.Response(body=body, content_type=STATIC_TYPES[suffix], charset="utf-8")


def finite(value):
    """`value` with every NaN or infinity replaced by None: browsers refuse JSON that holds them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _plain(value):
    """JSON for what json.dumps does not know: tuples and sets as lists, anything else as text."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)
