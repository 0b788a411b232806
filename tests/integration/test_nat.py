"""Volunteers behind home routers, in a real NAT topology (network namespaces, MASQUERADE, new
inbound connections dropped): two home nodes join with nothing but `--initial-peers` and
`--stage auto` (plus the run's config file and a step count), are reached over libp2p (over
connections they opened to public peers, and through the bootstrap's relay splice between the two
homes), train with the public replicas, pair in outer rounds
with each other and with the public replica of their stage, and `status` says how each is reached.
Neither home node can be dialled directly from the public namespace, checked before training."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import prepare_tokenizer, tiny_overrides
from .netns_topology import NatTopology, unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
STEPS, H = 24, 4
ROOT = Path(__file__).resolve().parents[2]


def _toml(overrides: list[str]) -> str:
    sections: dict[str, list[str]] = {}
    for item in overrides:
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        try:
            float(value)
            literal = value
        except ValueError:
            literal = json.dumps(value)
        sections.setdefault(section, []).append(f"{field} = {literal}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} not written (exit {proc.poll()}); log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    text = path.read_text()
    return json.loads(text) if text.startswith("{") else {"text": text}


def _dialable(ns_run, host: str, port: int) -> bool:
    """Whether a TCP connection from the public namespace to host:port is accepted."""
    code = (f"import socket; s=socket.socket(); s.settimeout(3)\n"
            f"try:\n s.connect(({host!r}, {port})); print('open')\nexcept OSError as e:\n print('closed', e)")
    out = ns_run([sys.executable, "-c", code])
    return out.strip().startswith("open")


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no NAT topology here: {unavailable_reason()}")
def test_home_nodes_behind_nat_join_train_and_pair(tmp_path):
    overrides = tiny_overrides(tmp_path, **{
        "pipeline.num_stages": 2, "outer.method": "noloco", "outer.inner_steps_per_outer": H,
        "inner.total_steps": STEPS, "timeouts.match_s": 8.0, "timeouts.rpc_s": 15.0, "timeouts.microbatch_s": 20.0,
        "timeouts.startup_s": 40.0, "timeouts.relay_s": 30.0, "log.progress": "off"})
    prepare_tokenizer(overrides)
    config = tmp_path / "run.toml"
    config.write_text(_toml(overrides))
    logs = tmp_path / "logs"
    logs.mkdir()
    base = [sys.executable, "-m", "noloco_node"]
    env_kw = dict(cwd=str(ROOT))

    with NatTopology() as topo:
        def start(ns: str, name: str, *argv: str) -> subprocess.Popen:
            log = open(logs / f"{name}.log", "w")
            return topo.run(ns, [*base, *argv], stdout=log, stderr=subprocess.STDOUT, **env_kw)

        def in_public(argv: list[str]) -> str:
            return subprocess.run(["ip", "netns", "exec", topo.public, *argv], capture_output=True, text=True,
                                  timeout=60, **env_kw).stdout

        pub = topo.public_ip
        boot = start(topo.public, "bootstrap", "bootstrap", "--config", str(config), "--host", pub, "--port", "31330",
                     "--identity", str(tmp_path / "boot.key"), "--maddr-file", str(tmp_path / "maddr"))
        maddr = _wait_file(tmp_path / "maddr", boot, logs / "bootstrap.log", 60)["text"].split()[0]
        common = ["--config", str(config), "--initial-peers", maddr, "--out", str(tmp_path / "nodes")]
        s1 = start(topo.public, "public-s1", "join", *common, "--stage", "1", "--host", pub,
                   "--ready-file", str(tmp_path / "public-s1.json"))
        _wait_file(tmp_path / "public-s1.json", s1, logs / "public-s1.log", 120)
        # The volunteers: nothing about the network. Stage 1 already has a replica, so both take stage 0.
        homes = [start(ns, f"home{i}", "join", *common, "--stage", "auto", "--steps", str(STEPS),
                       "--ready-file", str(tmp_path / f"home{i}.json")) for i, ns in enumerate(topo.homes, 1)]
        infos = [_wait_file(tmp_path / f"home{i}.json", p, logs / f"home{i}.log", 180) for i, p in enumerate(homes, 1)]
        assert [i["stage"] for i in infos] == [0, 0], infos
        assert all(i["reach"] in ("holepunched", "relayed") for i in infos), infos
        assert all(any("p2p-circuit" in a for a in i["p2p_addrs"]) for i in infos), infos

        # No direct path: the home nodes' gRPC ports cannot be reached from the public side.
        for info, wan, lan in zip(infos, topo.router_wan_ips, topo.home_ips):
            port = int(info["address"].rpartition(":")[2])
            assert not _dialable(in_public, wan, port), f"{wan}:{port} is dialable from the public namespace"
            assert not _dialable(in_public, lan, port), f"{lan}:{port} is dialable from the public namespace"

        s0 = start(topo.public, "public-s0", "join", *common, "--stage", "0", "--host", pub, "--steps", str(STEPS),
                   "--ready-file", str(tmp_path / "public-s0.json"))
        _wait_file(tmp_path / "public-s0.json", s0, logs / "public-s0.log", 120)

        status = json.loads(in_public([*base, "status", "--json", "--config", str(config), "--initial-peers", maddr]))
        reach = {r["peer_id"]: r["reach"] for r in status["replicas"]}
        print("\nstatus reach:", {p[-8:]: r for p, r in reach.items()})
        assert all(reach.get(i["peer_id"]) in ("holepunched", "relayed") for i in infos), reach

        for proc, name in [(homes[0], "home1"), (homes[1], "home2"), (s0, "public-s0")]:
            try:
                proc.wait(timeout=360)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish; log:\n{(logs / f'{name}.log').read_text()[-4000:]}")
            assert proc.returncode == 0, (logs / f"{name}.log").read_text()[-4000:]
        s1.terminate()
        s1.wait(timeout=60)

    stats = {json.loads(p.read_text())["peer_id"]: json.loads(p.read_text()) for p in (tmp_path / "nodes").glob("*.json")}
    home_ids = [i["peer_id"] for i in infos]
    for peer in home_ids:
        s = stats[peer]
        mb = s["microbatches"]
        partners = [h.get("partner") for h in s["outer_history"] if h.get("outcome") == "paired"]
        print(f"home {peer[-8:]}: reach {s['transport']['reach']}, bytes by path {s['transport']['bytes_by_path']}, "
              f"microbatches {mb}, losses {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}, partners "
              f"{[p[-8:] if p else p for p in partners]}")
        assert mb["issued"] == mb["completed"] + mb["dropped"] and mb["dropped"] == 0, mb
        assert s["inner_steps"] == STEPS
        assert sum(s["losses"][-4:]) / 4 < sum(s["losses"][:4]) / 4, s["losses"]
        assert partners, s["outer_history"]
        libp2p_bytes = sum(sum(v.values()) for path, v in s["transport"]["bytes_by_path"].items() if path != "direct")
        assert libp2p_bytes > 0, s["transport"]
    paired_with = {p: {h.get("partner") for h in stats[p]["outer_history"] if h.get("outcome") == "paired"}
                   for p in home_ids}
    assert home_ids[1] in paired_with[home_ids[0]] or home_ids[0] in paired_with[home_ids[1]], paired_with
    # Home to home runs through the bootstrap's relay splice, and it is not capped the way p2pd's
    # circuits are (128 KiB per direction): together the homes moved more than that through it.
    relayed = [stats[p]["transport"]["bytes_by_path"].get("relayed", {}) for p in home_ids]
    assert sum(r.get("out", 0) for r in relayed) > 2 * 131072, relayed
