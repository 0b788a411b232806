"""'[HOST:]PORT' as the dashboards take it (`network.dashboard`, `bootstrap --dashboard`)."""

from __future__ import annotations

LOCAL_ONLY = "127.0.0.1"


def parse_listen(value: str, *, default_host: str = LOCAL_ONLY) -> tuple[str, int]:
    """'[HOST:]PORT' -> (host, port), a bare PORT on this machine only; raises ValueError saying
    what a valid value looks like."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]") if sep else default_host
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise ValueError(
            f"{value!r} is not [HOST:]PORT; use e.g. 8080 (this machine only) or 0.0.0.0:8080 "
            f"(everyone who can reach the port)"
        )
    return host, int(port)
