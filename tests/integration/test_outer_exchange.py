"""NoLoCo outer rounds between real peer processes over gRPC and the DHT (noloco_node/experiments/outer_peer.py):
the V1 vectors exactly, bf16 wire values bit for bit, one pair + one solo among three, hostile
partners rejected and banned, and a partner that dies mid-exchange."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noloco_node.wire.codec import decode, encode
from noloco_node.optim.outer import noloco_step, solo_step

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
f64 = torch.float64
A = dict(phi=[1.0, -2.0, 0.5, 3.0], theta=[1.5, -2.5, 0.25, 3.0], momentum=[0.1, -0.2, 0.0, 0.4])
B = dict(phi=[0.0, -1.0, 1.0, 2.0], theta=[-0.5, -0.5, 1.5, 2.25], momentum=[0.3, 0.0, -0.1, 0.2])
NOLOCO = dict(alpha=0.5, beta=0.7)


def t(values):
    return torch.tensor(values, dtype=f64)


def wire(x, codec):
    spec, payload = encode(x, codec)
    return decode(spec, payload)


class Peers:
    def __init__(self, tmp_path: Path) -> None:
        self.dir, self.procs, self.go = tmp_path, [], tmp_path / "go"

    def start(self, name: str, state: dict, *extra: str) -> dict:
        save_file({k: t(v) for k, v in state.items()}, str(self.dir / f"{name}.state"))
        ready = self.dir / f"{name}.ready"
        initial = ["--initial-peers", self.first_maddr] if self.procs else []
        log = open(self.dir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "noloco_node.experiments.outer_peer", "--state", str(self.dir / f"{name}.state"),
                                 "--out", str(self.dir / f"{name}.out"), "--ready-file", str(ready), "--go-file", str(self.go),
                                 *initial, *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (self.dir / f"{name}.log").read_text()[-2000:]
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        if len(self.procs) == 1:
            self.first_maddr = info["maddrs"][0]
        return info

    def run_round(self, timeout_s: float = 60) -> dict:
        time.sleep(0.5)  # let every record propagate before the round (DHT store is asynchronous)
        self.go.touch()
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = (self.dir / f"{name}.out").exists()
                raise AssertionError(f"{name} still running after {timeout_s:.0f} s (result written: {out}); its log:\n"
                                     + (self.dir / f"{name}.log").read_text()[-4000:]) from None
        results = {}
        for name, _ in self.procs:
            out = self.dir / f"{name}.out"
            if out.exists():
                results[name] = {**load_file(str(out)), **json.loads(Path(str(out) + ".json").read_text())}
        return results

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def peers(tmp_path):
    p = Peers(tmp_path)
    yield p
    p.stop()


def test_two_peers_reach_exactly_v1(peers):
    peers.start("a", A, "--codec", "none")
    peers.start("b", B, "--codec", "none")
    results = peers.run_round()
    assert results["a"]["outcome"] == results["b"]["outcome"] == "paired"
    torch.testing.assert_close(results["a"]["phi"], t([0.7, -1.75, 0.7625, 2.9375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["a"]["momentum"], t([-0.3, 0.25, 0.2625, -0.0625]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["b"]["phi"], t([0.5, -1.35, 0.8625, 2.5375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(results["b"]["momentum"], t([0.5, -0.35, -0.1375, 0.5375]), atol=1e-9, rtol=0)
    assert torch.equal(results["a"]["theta"], results["a"]["phi"])  # theta <- phi


def test_bf16_wire_values_bit_for_bit(peers):
    peers.start("a", A, "--codec", "bf16")
    peers.start("b", B, "--codec", "bf16")
    results = peers.run_round()
    for me, other in (("a", B), ("b", A)):
        mine = A if me == "a" else B
        phi, m = noloco_step(t(mine["phi"]), wire(t(mine["theta"]), "bf16"), t(mine["momentum"]),
                             [(None, wire(t(other["theta"]), "bf16"))], **NOLOCO)
        assert torch.equal(results[me]["phi"], phi) and torch.equal(results[me]["momentum"], m)


def test_three_replicas_one_pair_one_solo(peers):
    states = {"a": A, "b": B, "c": A}
    for name, state in states.items():
        peers.start(name, state, "--codec", "none", "--match-s", "4")
    results = peers.run_round()
    outcomes = sorted(r["outcome"] for r in results.values())
    assert outcomes == ["paired", "paired", "solo"]
    by_peer = {r["peer_id"]: name for name, r in results.items()}
    for name, r in results.items():
        mine = states[name]
        if r["outcome"] == "solo":
            expected, _ = solo_step(t(mine["phi"]), t(mine["theta"]), t(mine["momentum"]), **NOLOCO)
        else:
            partner = states[by_peer[r["history"][0]["partner"]]]
            expected, _ = noloco_step(t(mine["phi"]), t(mine["theta"]), t(mine["momentum"]),
                                      [(None, t(partner["theta"]))], **NOLOCO)
        torch.testing.assert_close(r["phi"], expected, atol=1e-12, rtol=0)
        assert r["counters"]["rounds"] == 1


@pytest.mark.parametrize("poison", ["nan", "scale"])
def test_hostile_snapshot_rejected_banned_and_solo(peers, poison):
    peers.start("honest", A, "--codec", "none")
    peers.start("hostile", B, "--codec", "none", "--poison", poison)
    results = peers.run_round()
    honest = results["honest"]
    expected, _ = solo_step(t(A["phi"]), t(A["theta"]), t(A["momentum"]), **NOLOCO)
    assert honest["outcome"] == "solo"
    assert honest["counters"]["rejected"] == 1 and honest["banned"] >= 1
    assert torch.isfinite(honest["phi"]).all()
    torch.testing.assert_close(honest["phi"], expected, atol=1e-12, rtol=0)


def test_partner_dies_mid_exchange(peers):
    peers.start("honest", A, "--codec", "none", "--match-s", "5")
    peers.start("dying", B, "--codec", "none", "--die-after-writes", "2")
    start = time.monotonic()
    results = peers.run_round()
    assert "dying" not in results  # it exited mid-stream
    honest = results["honest"]
    expected, _ = solo_step(t(A["phi"]), t(A["theta"]), t(A["momentum"]), **NOLOCO)
    assert honest["outcome"] == "solo"
    torch.testing.assert_close(honest["phi"], expected, atol=1e-12, rtol=0)
    assert honest["history"][0]["seconds"] < 5 + 5 + 1  # its deadline (match_s) plus a session's own
    assert time.monotonic() - start < 30
