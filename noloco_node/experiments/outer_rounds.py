"""One outer round among N replicas of a stage, each peer a process
(experiments/outer_peer.py), optionally every peer behind a WAN relay: NoLoCo's pairwise
exchange over gRPC, DiLoCo's all-reduce over hivemind (its peer announces the relay address).
Used by benchmarks/outer_sync.py and by `noloco-node experiment`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from noloco_node.experiments.ports import RelayProcess, free_ports
from noloco_node.experiments.preloaded import PreloadedProcess
from noloco_node.experiments.process_group import ProcessGroup
from noloco_node.netem.relay import LinkProfile


def run_round(
    method: str,
    n: int,
    work: Path,
    *,
    numel: int,
    codec: str = "bf16",
    match_s: float = 10.0,
    matchmaking_s: float = 1.0,
    profile: LinkProfile | None = None,
) -> list[dict]:
    """Each peer's result dict (outcome, bytes_sent, history with the round's seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    go = work / "go"
    go.unlink(missing_ok=True)
    procs, maddr, relay, group = [], None, None, ProcessGroup()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    ports = free_ports(4 * n)
    grpc_ports, grpc_relays, dht_ports, dht_relays = (ports[i * n : (i + 1) * n] for i in range(4))
    try:
        if profile is not None:
            routes = dict(zip(grpc_relays, grpc_ports)) | dict(zip(dht_relays, dht_ports))
            relay = RelayProcess(profile, routes, work)
        for i in range(n):
            ready = work / f"p{i}.ready"
            cmd = _peer_command(
                method, i, n, work, go, numel=numel, codec=codec, match_s=match_s, matchmaking_s=matchmaking_s
            )
            if relay is not None:
                cmd += _relayed_addresses(grpc_ports[i], grpc_relays[i], dht_ports[i], dht_relays[i])
            if maddr:
                cmd += ["--initial-peers", maddr]
            with open(work / f"p{i}.log", "w") as log:
                procs.append(group.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            _wait_ready(procs[-1], ready, work / f"p{i}.log")
            maddr = maddr or json.loads(ready.read_text())["maddrs"][0]
        time.sleep(1.0)  # let every DHT record propagate
        go.touch()
        for proc in procs:
            proc.wait(timeout=match_s + 120)
        return [json.loads((work / f"p{i}.out.json").read_text()) for i in range(n)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        group.drain(grace_s=5.0)  # a killed hivemind peer leaves its p2pd daemon in the group
        if relay is not None:
            relay.stop()


def _peer_command(
    method: str,
    i: int,
    n: int,
    work: Path,
    go: Path,
    *,
    numel: int,
    codec: str,
    match_s: float,
    matchmaking_s: float,
) -> list[str]:
    """Peer i's outer_peer command line, before its addresses and initial peers."""
    return [
        sys.executable,
        "-m",
        "noloco_node.experiments.outer_peer",
        "--numel",
        str(numel),
        "--seed",
        str(i),
        "--method",
        method,
        "--codec",
        codec,
        "--match-s",
        str(match_s),
        "--matchmaking-s",
        str(matchmaking_s),
        "--group-size",
        str(n),
        "--out",
        str(work / f"p{i}.out"),
        "--ready-file",
        str(work / f"p{i}.ready"),
        "--go-file",
        str(go),
    ]


def _relayed_addresses(grpc_port: int, grpc_relay: int, dht_port: int, dht_relay: int) -> list[str]:
    """Behind the relay a peer listens on its own ports but announces the relay's, so every
    other peer reaches it through the link profile."""
    return [
        "--port",
        str(grpc_port),
        "--announce-addr",
        f"127.0.0.1:{grpc_relay}",
        "--dht-port",
        str(dht_port),
        "--dht-announce",
        f"127.0.0.1:{dht_relay}",
    ]


def _wait_ready(proc: subprocess.Popen | PreloadedProcess, ready: Path, log: Path) -> None:
    """Peers start one by one: the next needs this one's multiaddr as its initial peer."""
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.05)
