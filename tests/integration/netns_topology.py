"""A real home-NAT topology in Linux network namespaces, for tests that need peers which cannot be
dialled directly (relay / hole-punching paths), not just a slow link on 127.0.0.1.

    public ns: bridge br0 198.18.0.1/24 (bootstrap, relay and public nodes, on different ports)
      |-- router1 ns: wan 198.18.0.11/24, lan 198.19.1.1/24, MASQUERADE, new inbound dropped
      |     '-- home1 ns: 198.19.1.2/24, default via 198.19.1.1
      '-- router2 ns: wan 198.18.0.12/24, lan 198.19.2.1/24, same rules
            '-- home2 ns: 198.19.2.2/24, default via 198.19.2.1

198.18.0.0/15 is the benchmarking range (RFC 2544): never routed on the internet, and the
namespaces have no link to the host's interfaces, so nothing here can leave the machine.
Caveat for libp2p (go-libp2p 0.32 in hivemind's p2pd): go-multiaddr counts 198.18.0.0/15 as
neither public nor private, so peers here learn no listen addresses through identify (DHT
FindPeer fails: dial by explicit address), AutoNAT never decides, autorelay advertises no
/p2p-circuit address and DCUtR never starts.

Needs root, iproute2 with `ip netns`, and iptables (nf_tables or legacy) usable in a namespace.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
import time
from typing import Any, Sequence

from noloco_node.experiments.process_group import ProcessGroup

PUBLIC_IP = "198.18.0.1"
ROUTER_WAN_IPS = ("198.18.0.11", "198.18.0.12")
ROUTER_LAN_IPS = ("198.19.1.1", "198.19.2.1")
HOME_IPS = ("198.19.1.2", "198.19.2.2")
_REPLIES_ONLY = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]


def _sh(argv: Sequence[str], ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    result = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why this machine cannot build the topology (for pytest.skip), or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (running as uid %d)" % os.geteuid()
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (apt-get install -y iproute2 iptables)"
    probe = f"nlprobe-{secrets.token_hex(3)}"
    try:
        _sh(["ip", "netns", "add", probe])
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` refused: {exc}"
    try:
        # The exact features the topology uses: a bridge, a veth pair, NAT, port forwarding, conntrack.
        _sh(["ip", "link", "add", "br0", "type", "bridge"], ns=probe)
        _sh(["ip", "link", "add", "va", "type", "veth", "peer", "name", "vb"], ns=probe)
        _sh(["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "va", "-j", "MASQUERADE"], ns=probe)
        _sh(
            [
                "iptables",
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-i",
                "va",
                "-p",
                "tcp",
                "--dport",
                "9",
                "-j",
                "DNAT",
                "--to-destination",
                "198.19.0.2:9",
            ],
            ns=probe,
        )
        _sh(["iptables", "-A", "FORWARD", *_REPLIES_ONLY], ns=probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"kernel/tools refuse part of the NAT topology: {exc}"
    finally:
        _sh(["ip", "netns", "del", probe], check=False)
    return None


class NatTopology:
    """Builds the topology on construction; `close()` (or leaving the `with` block) kills every
    process started through `run()` and deletes every namespace, also after a failed build."""

    def __init__(self, tag: str = "nl") -> None:
        suffix = secrets.token_hex(3)  # parallel runs get distinct namespace names
        self.public = f"{tag}pub-{suffix}"
        self.routers = (f"{tag}r1-{suffix}", f"{tag}r2-{suffix}")
        self.homes = (f"{tag}h1-{suffix}", f"{tag}h2-{suffix}")
        self.public_ip = PUBLIC_IP
        self.router_wan_ips = ROUTER_WAN_IPS
        self.home_ips = HOME_IPS
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    def _add_ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._created.append(name)  # recorded at once so close() removes it even if a later step fails
        _sh(["ip", "link", "set", "lo", "up"], ns=name)

    def _build(self) -> None:
        self._add_ns(self.public)
        _sh(["ip", "link", "add", "br0", "type", "bridge"], ns=self.public)
        _sh(["ip", "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0"], ns=self.public)
        _sh(["ip", "link", "set", "br0", "up"], ns=self.public)
        for i, (router, home) in enumerate(zip(self.routers, self.homes), start=1):
            self._add_ns(router)
            self._add_ns(home)
            # Create each veth end directly inside its namespace: the names never exist in the
            # host namespace, so they cannot collide with a parallel run.
            _sh(["ip", "link", "add", "wan", "netns", router, "type", "veth", "peer", f"r{i}", "netns", self.public])
            _sh(["ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "eth0", "netns", home])
            _sh(["ip", "link", "set", f"r{i}", "master", "br0", "up"], ns=self.public)
            _sh(["ip", "addr", "add", f"{ROUTER_WAN_IPS[i - 1]}/24", "dev", "wan"], ns=router)
            _sh(["ip", "addr", "add", f"{ROUTER_LAN_IPS[i - 1]}/24", "dev", "lan"], ns=router)
            _sh(["ip", "link", "set", "wan", "up"], ns=router)
            _sh(["ip", "link", "set", "lan", "up"], ns=router)
            _sh(["ip", "addr", "add", f"{HOME_IPS[i - 1]}/24", "dev", "eth0"], ns=home)
            _sh(["ip", "link", "set", "eth0", "up"], ns=home)
            _sh(["ip", "route", "add", "default", "via", ROUTER_LAN_IPS[i - 1]], ns=home)
            self._make_nat(router)

    @staticmethod
    def _make_nat(router: str) -> None:
        _sh(["sysctl", "-qw", "net.ipv4.ip_forward=1"], ns=router)  # per-namespace setting
        rules = [
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
            # A home router: replies to what the LAN opened come back in; nothing new from the WAN.
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", *_REPLIES_ONLY],
            ["-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
        ]
        for rule in rules:
            _sh(["iptables", *rule], ns=router)

    def forward_port(self, home: int, port: int) -> None:
        """What a volunteer does on their router: new connections to the WAN address's TCP `port`
        go to the same port of home `home` (1 or 2). Deleting the router's namespace removes it."""
        router, lan_ip = self.routers[home - 1], HOME_IPS[home - 1]
        _sh(
            [
                "iptables",
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-i",
                "wan",
                "-p",
                "tcp",
                "--dport",
                str(port),
                "-j",
                "DNAT",
                "--to-destination",
                f"{lan_ip}:{port}",
            ],
            ns=router,
        )
        _sh(
            [
                "iptables",
                "-A",
                "FORWARD",
                "-i",
                "wan",
                "-o",
                "lan",
                "-p",
                "tcp",
                "-d",
                lan_ip,
                "--dport",
                str(port),
                "-j",
                "ACCEPT",
            ],
            ns=router,
        )

    def run(self, ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside namespace ns in its own process group, so close() can kill the whole
        tree (e.g. a Python script and the p2pd daemons it spawned). A node is forked from the
        launcher's zygote, which enters the namespace as `ip netns exec` would; anything else is
        run by `ip netns exec` itself."""
        if ns not in self._created:
            raise ValueError(f"{ns} is not a namespace of this topology")
        proc = ProcessGroup().spawn(argv, netns=ns, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def close(self, grace_s: float = 3.0) -> None:
        for proc in self._procs:
            self._signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # SIGKILL the group even when the leader exited: daemons it spawned may survive it.
            self._signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        # Deleting a namespace also destroys its veth ends, bridge and iptables rules.
        for name in reversed(self._created):
            self._kill_leftovers(name)
            _sh(["ip", "netns", "del", name], check=False)
        self._created.clear()

    @staticmethod
    def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _kill_leftovers(ns: str) -> None:
        """Processes that left our process groups (setsid) would keep the namespace alive."""
        result = _sh(["ip", "netns", "pids", ns], check=False)
        for pid in result.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def __enter__(self) -> "NatTopology":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
