"""Deadlines that follow the link, between real peer processes (experiments/outer_peer.py) whose
gRPC ports sit behind the project's netem relay at 4 Mbit/s each way:

- an outer exchange of 4 MB each way (about 8 s at that rate, so past the 5 s the NoLoCo round
  used to allow for everything) completes, both peers measure the link near 4 Mbit/s, and
  `noloco-node status` shows it; with the deadlines pinned to the old fixed 5 s, the same
  exchange is cut and both peers go solo;
- a partner that stops sending mid-exchange is cut at its derived progress deadline (about 5 s:
  a chunk's time at the assumed rate, times the slack), far inside the exchange's derived total
  deadline (about 38 s);
- a 6 MB state fetch (about 12 s) completes although its fixed deadline (floor) is 3 s.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from noloco_node.experiments.ports import RelayProcess, free_ports
from noloco_node.experiments.process_group import ProcessGroup
from noloco_node.netem.relay import LinkProfile

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
MBIT = 4.0
NUMEL = 1_000_000  # float32, theta alone: 4 MB each way
MATCH_S = 5.0


class RelayedPeers:
    """outer_peer processes, each announcing its gRPC port through one relay at MBIT."""

    def __init__(self, work: Path, count: int) -> None:
        self.work, self.go, self.procs, self.maddr = work, work / "go", {}, None
        ports = free_ports(2 * count)
        self.grpc, self.relayed = ports[:count], ports[count:]
        self.relay = RelayProcess(
            LinkProfile("slow", one_way_ms=5.0, mbit=MBIT), dict(zip(self.relayed, self.grpc)), work
        )

    def start(self, name: str, *extra: str) -> dict:
        i, ready = len(self.procs), self.work / f"{name}.ready"
        cmd = [
            sys.executable,
            "-m",
            "noloco_node.experiments.outer_peer",
            "--numel",
            str(NUMEL),
            "--seed",
            str(i),
            "--codec",
            "none",
            "--match-s",
            str(MATCH_S),
            "--out",
            str(self.work / f"{name}.out"),
            "--ready-file",
            str(ready),
            "--go-file",
            str(self.go),
            "--port",
            str(self.grpc[i]),
            "--announce-addr",
            f"127.0.0.1:{self.relayed[i]}",
            *extra,
        ]
        if self.maddr:
            cmd += ["--initial-peers", self.maddr]
        with open(self.work / f"{name}.log", "w") as log:
            # A group of its own (killed alone), forked from the zygote where it can be.
            self.procs[name] = ProcessGroup().spawn(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.procs[name].poll() is None and time.monotonic() < deadline, self.log(name)
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.maddr = self.maddr or info["maddrs"][0]
        return info

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text()[-3000:]

    def begin(self) -> float:
        time.sleep(0.5)  # every record propagated (the DHT store is asynchronous)
        self.go.touch()
        return time.monotonic()

    def result(self, name: str, timeout_s: float = 90) -> dict:
        out = self.work / f"{name}.out.json"
        deadline = time.monotonic() + timeout_s
        while not out.exists():
            assert time.monotonic() < deadline, f"{name} wrote no result in {timeout_s:.0f} s:\n{self.log(name)}"
            time.sleep(0.05)
        time.sleep(0.1)
        return {**json.loads(out.read_text()), **load_file(str(self.work / f"{name}.out"))}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.relay.stop()


@pytest.fixture
def peers_of(tmp_path):
    made = []

    def make(count: int) -> RelayedPeers:
        made.append(RelayedPeers(tmp_path, count))
        return made[-1]

    yield make
    for peers in made:
        peers.stop()


def _measured_mbit(result: dict, partner: str) -> float:
    return result["links"][partner]["received_mbit_s"]


def test_exchange_slower_than_the_old_fixed_deadline_completes_and_status_shows_the_link(peers_of, tmp_path):
    peers = peers_of(2)
    stop = tmp_path / "stop"
    a = peers.start("a", "--serve-until", str(stop))
    b = peers.start("b", "--serve-until", str(stop))
    peers.begin()
    results = {name: peers.result(name) for name in "ab"}
    for name, partner in (("a", b), ("b", a)):
        r = results[name]
        assert r["outcome"] == "paired", peers.log(name)
        # the whole round took longer than the 5 s that used to bound it, exchange included
        assert r["history"][0]["seconds"] > MATCH_S + 1, r["history"]
        assert 0.5 * MBIT < _measured_mbit(r, partner["peer_id"]) < 1.1 * MBIT, r["links"]
    print(
        f"\nrounds took {[results[n]['history'][0]['seconds'] for n in 'ab']} s; measured "
        f"{[_measured_mbit(results[n], p['peer_id']) for n, p in (('a', b), ('b', a))]} Mbit/s"
    )

    time.sleep(1.0)  # both announced their record with the measured link after the round
    flags = ["--initial-peers", peers.maddr, "--set", "run.run_id=outer-test", "--set", "pipeline.num_stages=1"]
    listing = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--json", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    table = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    stop.touch()
    assert listing.returncode == 0 and table.returncode == 0, listing.stderr[-2000:] + table.stderr[-2000:]
    shown = {r["peer_id"]: r["link_mbit_s"] for r in json.loads(listing.stdout)["replicas"]}
    assert set(shown) == {a["peer_id"], b["peer_id"]}
    assert all(0.5 * MBIT < mbit < 1.1 * MBIT for mbit in shown.values()), shown
    assert "link Mb/s" in table.stdout, table.stdout


def test_the_same_exchange_under_the_old_fixed_deadline_is_cut(peers_of):
    peers = peers_of(2)
    for name in "ab":  # the ceiling pinned to match_s: every exchange gets 5 s, whatever its size
        peers.start(name, "--deadline-ceiling-s", str(MATCH_S))
    peers.begin()
    results = {name: peers.result(name) for name in "ab"}
    assert [r["outcome"] for r in results.values()] == ["solo", "solo"], [peers.log(n) for n in "ab"]
    # whoever hit the 5 s first cut it (the other saw its partner end the exchange)
    assert any("its derived deadline" in peers.log(n) for n in "ab"), [peers.log(n) for n in "ab"]
    assert sum(r["counters"]["timed_out"] for r in results.values()) >= 1


def test_partner_that_stops_sending_is_cut_at_its_progress_deadline(peers_of):
    peers = peers_of(2)
    peers.start("honest", "--stall-s", "2")
    # its 3rd write of the exchange is its first chunk: manifest and header out, then nothing for 60 s
    peers.start("staller", "--stall-s", "2", "--fault", "exchange_write:stall=60@3")
    began = peers.begin()
    honest = peers.result("honest")
    took = time.monotonic() - began
    assert honest["outcome"] == "solo" and honest["counters"]["timed_out"] == 1, peers.log("honest")
    # The derived progress deadline: stall_s (2 s), or a 1 MiB chunk's time at the assumed 5 Mbit/s
    # x 3 (5.0 s) where longer; the exchange's derived total (8 MB at that rate x 3) is ~38 s.
    cut = re.search(r"no message for ([\d.]+) s \(progress deadline ([\d.]+) s\)", peers.log("honest"))
    assert cut is not None, peers.log("honest")
    waited, limit = float(cut.group(1)), float(cut.group(2))
    assert 2.0 <= limit < 6.0 and limit <= waited < limit + 1.5, (waited, limit)
    assert honest["history"][0]["seconds"] < MATCH_S + limit + 2, honest["history"]
    assert took < 20, took
    print(
        f"\nno message for {waited} s (progress deadline {limit} s): the honest peer went solo "
        f"{honest['history'][0]['seconds']:.1f} s into its round"
    )


def test_state_fetch_over_a_slow_link_completes_past_its_fixed_deadline(peers_of, tmp_path):
    peers = peers_of(2)
    numel = 750_000  # phi and momentum, float32: 6 MB, about 12 s at 4 Mbit/s
    donor = peers.start(
        "donor", "--numel", str(numel), "--rounds", "0", "--serve-until", str(tmp_path / "joiner.out.json")
    )
    peers.start("joiner", "--numel", str(numel), "--fetch-state", "--rpc-s", "3")
    peers.begin()
    joiner, donor_out = peers.result("joiner"), peers.result("donor")
    assert joiner["outcome"] == "fetched" and joiner["donor"] == donor["peer_id"], peers.log("joiner")
    assert joiner["phi"].equal(donor_out["phi"]) and joiner["momentum"].equal(donor_out["momentum"])
    assert joiner["fetch_s"] > 2 * 3, joiner["fetch_s"]  # well past the 3 s a fixed deadline allowed
    assert 0.5 * MBIT < _measured_mbit(joiner, donor["peer_id"]) < 1.1 * MBIT, joiner["links"]
    print(f"\nstate fetch took {joiner['fetch_s']:.1f} s")
