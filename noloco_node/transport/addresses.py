"""Hosts and multiaddrs: which name this machine only."""

from __future__ import annotations


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    return host.startswith("127.") or host in ("localhost", "::1")


def maddr_host(maddr: str) -> str | None:
    """The host a multiaddr names (`/ip4/HOST/...`, ip6, dns), or None."""
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else None


def maddr_is_loopback(maddr: str) -> bool:
    """Whether a multiaddr dials this machine only (a bootstrap prints one for 127.0.0.1 too)."""
    host = maddr_host(maddr)
    return host is not None and is_loopback(host)
