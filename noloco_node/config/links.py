"""The sections of how a node talks: its network addresses and ports, its security (keys, limits,
admission) and its timeouts (deadlines derived from links). Split from sections.py, which holds the
rest; `noloco_node.config` exports them all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from noloco_node.config.checks import _require
from noloco_node.config.listen import parse_listen
from noloco_node.config.peer_ids import is_peer_id


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkConfig:
    host: str = "127.0.0.1"
    """Address the gRPC server and the libp2p daemon bind; 0.0.0.0 = every interface (peers are
    then told the address the DHT peers observe, unless announce_addr says otherwise)."""
    port: int = 0
    """gRPC port; 0 = any free port."""
    announce_addr: str | None = None
    """host:port peers should dial; None = host:bound port."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of DHT peers to bootstrap from."""
    dht_port: int = 0
    metrics_port: int | None = None
    """Prometheus /metrics port on `host`; None = off, 0 = any free port."""
    dashboard: str | None = None
    """[HOST:]PORT of this node's web page and JSON (docs/dashboard.md); a bare PORT binds 127.0.0.1
    (this machine only); None = off, port 0 = any free port (the ready file says which)."""
    dashboard_poll_s: float = 5.0
    """How often the dashboard samples the node (and reads the swarm's records for its swarm page)."""
    allreduce_port: int = 0
    """diloco/dp: TCP port of the all-reduce's hivemind peer (0 = any)."""
    allreduce_announce: str | None = None
    """diloco/dp: host:port other replicas dial for the all-reduce (e.g. a WAN relay); None = direct."""
    check_reachability: bool = True
    """At join, ask live peers to dial our announced address (see `reach`)."""
    reach: str = "auto"
    """How peers reach this node: auto = direct TLS gRPC when live peers can dial our address, else
    gRPC over libp2p (hole-punched or through a relay); direct = fail (exit 4) when they cannot;
    libp2p = always over libp2p (behind NAT, skips the probe)."""
    relays: tuple[str, ...] = ()
    """Multiaddrs of public peers to reserve a relay slot on when behind NAT; () = the initial peers."""
    reprobe_s: float = 60.0
    """reach = auto, served over libp2p because no peer could prove it dials our address: ask
    again after this many seconds, doubling after each failed probe up to 16x; the first success
    moves the node to direct. 0 = never ask again (the next start probes anew)."""

    def __post_init__(self) -> None:
        if self.metrics_port is not None:
            _require(
                0 <= self.metrics_port <= 65535,
                "metrics_port",
                f"{self.metrics_port} is not a TCP port",
                "use 0..65535",
            )
        if self.dashboard is not None:
            try:
                parse_listen(self.dashboard)
            except ValueError as exc:
                _require(False, "dashboard", str(exc), 'e.g. dashboard = "8080"')
        _require(
            self.dashboard_poll_s > 0,
            "dashboard_poll_s",
            f"must be > 0 seconds, got {self.dashboard_poll_s}",
            "use e.g. 5",
        )
        for name in ("initial_peers", "relays"):
            for addr in getattr(self, name):
                _check_multiaddr(name, addr)
        for name in ("port", "dht_port", "allreduce_port"):
            _require(
                0 <= getattr(self, name) <= 65535, name, f"{getattr(self, name)} is not a TCP port", "use 0..65535"
            )
        if self.announce_addr is not None:
            host, _, port = self.announce_addr.rpartition(":")
            _require(
                bool(host) and port.isdigit(),
                "announce_addr",
                f"{self.announce_addr!r} is not host:port",
                "use e.g. 203.0.113.7:31337",
            )
        _require(
            self.reach in ("auto", "direct", "libp2p"),
            "reach",
            f"unknown reach {self.reach!r}",
            "use auto, direct or libp2p",
        )
        _require(
            self.reprobe_s >= 0,
            "reprobe_s",
            f"must be >= 0 seconds, got {self.reprobe_s}",
            "use a number of seconds, e.g. 60, or 0 to never re-probe",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SecurityConfig:
    """Admission and limits on what one peer may cost this node."""

    swarm_key_file: str | None = None
    """File holding the swarm's shared secret (`noloco-node keygen`). With it every gRPC call and
    DHT request must carry an HMAC made with the same key; None = an open swarm."""
    max_clock_skew_s: float = 60.0
    """A signed call's timestamp may differ from our clock by at most this."""
    identity_file: str | None = None
    """This node's identity key (libp2p key, record and call signing key); created on first use.
    Keeps the peer id across restarts; None = a fresh identity every start."""
    min_receive_bytes_per_s: float = 1e6
    """A Forward/Backward stream must deliver its payload at least this fast (after timeouts.receive_s
    for the header): a stalled stream is cut with DEADLINE_EXCEEDED and its in-flight slot freed."""
    max_concurrent_rpcs: int = 64
    """Calls served at once, all peers together; more get RESOURCE_EXHAUSTED."""
    peer_max_streams: int = 16
    """Calls served at once for one peer."""
    peer_requests_per_s: float = 200.0
    """Sustained calls per second one peer may make (token bucket)."""
    peer_burst: int = 400
    """Calls one peer may make at once before the rate applies."""
    ban_after_invalid: int = 5
    """Messages from one peer rejected as INVALID_ARGUMENT before it is banned (unsigned calls are
    refused without counting: they carry no identity to ban)."""
    ban_after_poisoned: int = 1
    """Payloads that would corrupt this stage (non-finite, or outside the running bounds below)
    before the sender is banned: by default the first."""
    ban_s: float = 30.0
    """First ban length; each further ban of the same peer doubles it, up to ban_max_s."""
    ban_max_s: float = 1800.0
    payload_rms_factor: float = 1000.0
    """Received activations and gradients must have an RMS within this factor of the median RMS
    of the last 64 this stage accepted in that direction (once 8 are in); else INVALID_ARGUMENT
    and the sender is banned (ban_after_poisoned)."""
    payload_max_abs: float = 1e6
    """No element of a received activation or gradient may exceed this magnitude (finite values
    like 3e38 overflow the next layer's norm into NaN)."""

    def __post_init__(self) -> None:
        _require(
            self.payload_rms_factor > 1,
            "payload_rms_factor",
            f"must be > 1, got {self.payload_rms_factor}",
            "use e.g. 1000 (a tenfold margin below the 1e4x scaling a hostile peer would use)",
        )
        for name in (
            "max_clock_skew_s",
            "peer_requests_per_s",
            "ban_s",
            "ban_max_s",
            "min_receive_bytes_per_s",
            "payload_max_abs",
        ):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}", "use a positive number")
        for name in (
            "max_concurrent_rpcs",
            "peer_max_streams",
            "peer_burst",
            "ban_after_invalid",
            "ban_after_poisoned",
        ):
            _require(
                getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}", "use a positive integer"
            )
        if self.swarm_key_file is not None:
            _require(
                Path(self.swarm_key_file).is_file(),
                "swarm_key_file",
                f"{self.swarm_key_file} is not a file",
                "create one with `noloco-node keygen --out swarm.key` and give every peer the same file",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeoutsConfig:
    rpc_s: float = 30.0
    """The floor of a Forward/Backward call's and of a state fetch's deadline: each gets this, or
    its payload's time at the peer's measured bandwidth times deadline_slack where that is longer
    (up to deadline_ceiling_s)."""
    connect_s: float = 5.0
    receive_s: float = 10.0
    """A caller must send a stream's header within this, whatever deadline it set itself; its payload
    then within this plus its size at security.min_receive_bytes_per_s, or at the caller's measured
    bandwidth / deadline_slack where that is slower (a slow link is not cut, a stalled one is: see stall_s)."""
    relay_s: float = 30.0
    """Behind NAT: how long to wait for a relay reservation before serving without one."""
    startup_s: float = 30.0
    """How long to wait for the DHT bootstrap before failing with a clear error."""
    match_s: float = 5.0
    """How long an outer step may look for a partner before the solo step. An exchange, once a
    partner accepted, gets its own deadline: the snapshot bytes both ways at the partner's measured
    bandwidth times deadline_slack, never less than this (both sides derive it), plus stall_s."""
    allreduce_s: float = 60.0
    """DiLoCo/dp: how long an all-reduce may run once its group formed (and a peer's stream may
    make no progress for max(5, 2 x match_s)) before the round fails and the step goes solo."""
    heartbeat_s: float = 10.0
    record_ttl_s: float = 30.0
    saved_input_ttl_s: float = 120.0
    """Saved forward inputs expire after this, so a lost downstream peer cannot leak memory."""
    microbatch_s: float = 60.0
    """Stage 0 re-issues a microbatch whose gradient has not returned within this time."""
    drain_s: float = 10.0
    """Graceful shutdown: how long to wait for microbatches in flight before leaving anyway."""
    assumed_mbit_s: float = 5.0
    """Deadlines that follow the link (runtime/link_estimates.py): the bandwidth taken for a peer
    this node has not measured yet (or the median of the peers it has, if slower). Set it near your
    own uplink on a link slower than this, so a first large transfer is not cut."""
    deadline_slack: float = 3.0
    """A transfer's derived deadline is this many times its time at the measured bandwidth."""
    deadline_ceiling_s: float = 3600.0
    """No derived deadline is longer than this (a 2.4 GB outer exchange at 10 Mbit/s needs ~2000 s)."""
    stall_s: float = 10.0
    """Progress deadline: a transfer that moves no message for this long (or for one 1 MiB chunk's
    time at the peer's bandwidth times deadline_slack, if longer) is cut, whatever its total deadline."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in ("assumed_mbit_s", "deadline_slack"):
                continue
            _require(
                getattr(self, f.name) > 0,
                f.name,
                f"must be > 0 seconds, got {getattr(self, f.name)}",
                "use a positive number of seconds",
            )
        _require(
            self.record_ttl_s > self.heartbeat_s,
            "record_ttl_s",
            f"{self.record_ttl_s} must exceed heartbeat_s {self.heartbeat_s}",
            "use about 3x heartbeat_s",
        )
        _require(
            self.assumed_mbit_s > 0,
            "assumed_mbit_s",
            f"must be > 0 Mbit/s, got {self.assumed_mbit_s}",
            "use your link's uplink bandwidth in Mbit/s, e.g. 5",
        )
        _require(
            self.deadline_slack >= 1,
            "deadline_slack",
            f"must be >= 1, got {self.deadline_slack}",
            "use e.g. 3 (a transfer may take three times its time at the measured bandwidth)",
        )
        for name in ("rpc_s", "match_s", "receive_s", "stall_s"):
            _require(
                self.deadline_ceiling_s >= getattr(self, name),
                "deadline_ceiling_s",
                f"{self.deadline_ceiling_s} is below {name} {getattr(self, name)}",
                f"use at least {name}; e.g. 3600 for large models on home links",
            )

    @property
    def outer_round_s(self) -> float:
        """How long an outer round may take to finish once it started: matchmaking and then the
        reduce, twice the match window plus 10 s. DiLoCo's and dp's all-reduce get it, and a node
        that stops waits this long for a running outer step."""
        return 2 * self.match_s + 10


def _check_multiaddr(name: str, addr: object) -> None:
    """What hivemind would refuse only after its daemon started, as an unreachable peer, or accept
    and then fail on in a task nobody reads."""
    _require(
        isinstance(addr, str) and addr.startswith("/") and "/p2p/" in addr,
        name,
        f"{addr!r} is not a multiaddr with a peer id",
        "use the whole multiaddr the bootstrap printed, e.g. /ip4/203.0.113.7/tcp/31330/p2p/12D3KooW...",
    )
    _require(
        "," not in addr and not any(c.isspace() for c in addr),
        name,
        f"{addr!r} holds more than one multiaddr",
        "give each multiaddr on its own: --initial-peers A B (spaces), or a list in the config",
    )
    peer = addr.rsplit("/p2p/", 1)[1]
    _require(
        not peer.endswith("/"),
        name,
        f"{addr!r} ends in '/'",
        "drop the trailing '/': a multiaddr ends with its peer id",
    )
    _require(
        is_peer_id(peer),
        name,
        f"{peer!r} in {addr!r} is not a peer id (a character mistyped or missing?)",
        "copy the multiaddr the bootstrap printed again, whole",
    )
