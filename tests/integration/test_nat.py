"""Volunteers behind home routers, in a real NAT topology (network namespaces, MASQUERADE, new
inbound connections dropped).

- Two home nodes join with nothing but `--initial-peers` and `--stage auto` (plus the run's config
  file and a step count), are reached over libp2p (over connections they opened to public peers,
  and through the bootstrap's relay splice between the two homes), train with the public replicas,
  pair in outer rounds with each other and with the public replica of their stage, and `status`
  says how each is reached. Neither home node can be dialled directly from the public namespace,
  checked before training.
- Only the bootstrap is public: the first home joiner serves stage 1 and shows as relayed (never as
  direct at an address nobody can dial), and a second home node trains through it.
- A relayed home node whose router starts forwarding its port is found reachable by a later
  probe (the bootstrap answers probes) and moves to direct while it serves; a public node then
  trains through it over direct TLS.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import prepare_tokenizer, tiny_overrides
from .netns_topology import NatTopology, unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
NO_NAT = unavailable_reason()
STEPS, H = 32, 4
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
    code = (
        f"import socket; s=socket.socket(); s.settimeout(3)\n"
        f"try:\n s.connect(({host!r}, {port})); print('open')\nexcept OSError as e:\n print('closed', e)"
    )
    out = ns_run([sys.executable, "-c", code])
    return out.strip().startswith("open")


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no NAT topology here: {unavailable_reason()}")
def test_home_nodes_behind_nat_join_train_and_pair(tmp_path):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": H,
            "inner.total_steps": STEPS,
            # Each home node must pair at least once, home with home through the relay splice; a clean-
            # clone CI run once saw the two never meet within 8 s windows (a loaded box, start skew).
            "timeouts.match_s": 12.0,
            "timeouts.rpc_s": 15.0,
            "timeouts.microbatch_s": 20.0,
            "timeouts.startup_s": 40.0,
            "timeouts.relay_s": 30.0,
            "log.progress": "off",
        },
    )
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
            return subprocess.run(
                ["ip", "netns", "exec", topo.public, *argv], capture_output=True, text=True, timeout=60, **env_kw
            ).stdout

        pub = topo.public_ip
        boot = start(
            topo.public,
            "bootstrap",
            "bootstrap",
            "--config",
            str(config),
            "--host",
            pub,
            "--port",
            "31330",
            "--identity",
            str(tmp_path / "boot.key"),
            "--maddr-file",
            str(tmp_path / "maddr"),
        )
        maddr = _wait_file(tmp_path / "maddr", boot, logs / "bootstrap.log", 60)["text"].split()[0]
        common = ["--config", str(config), "--initial-peers", maddr, "--out", str(tmp_path / "nodes")]
        s1 = start(
            topo.public,
            "public-s1",
            "join",
            *common,
            "--stage",
            "1",
            "--host",
            pub,
            "--ready-file",
            str(tmp_path / "public-s1.json"),
        )
        _wait_file(tmp_path / "public-s1.json", s1, logs / "public-s1.log", 120)
        # The volunteers: nothing about the network. Stage 1 already has a replica, so both take stage 0.
        homes = [
            start(
                ns,
                f"home{i}",
                "join",
                *common,
                "--stage",
                "auto",
                "--steps",
                str(STEPS),
                "--ready-file",
                str(tmp_path / f"home{i}.json"),
            )
            for i, ns in enumerate(topo.homes, 1)
        ]
        infos = [_wait_file(tmp_path / f"home{i}.json", p, logs / f"home{i}.log", 180) for i, p in enumerate(homes, 1)]
        assert [i["stage"] for i in infos] == [0, 0], infos
        assert all(i["reach"] in ("holepunched", "relayed") for i in infos), infos
        assert all(any("p2p-circuit" in a for a in i["p2p_addrs"]) for i in infos), infos

        # No direct path: the home nodes' gRPC ports cannot be reached from the public side.
        for info, wan, lan in zip(infos, topo.router_wan_ips, topo.home_ips):
            port = int(info["address"].rpartition(":")[2])
            assert not _dialable(in_public, wan, port), f"{wan}:{port} is dialable from the public namespace"
            assert not _dialable(in_public, lan, port), f"{lan}:{port} is dialable from the public namespace"

        # While the homes train (with int8 hops they can finish before a later joiner is up).
        status = json.loads(in_public([*base, "status", "--json", "--config", str(config), "--initial-peers", maddr]))
        reach = {r["peer_id"]: r["reach"] for r in status["replicas"]}
        print("\nstatus reach:", {p[-8:]: r for p, r in reach.items()})
        assert all(reach.get(i["peer_id"]) in ("holepunched", "relayed") for i in infos), reach

        s0 = start(
            topo.public,
            "public-s0",
            "join",
            *common,
            "--stage",
            "0",
            "--host",
            pub,
            "--steps",
            str(STEPS),
            "--ready-file",
            str(tmp_path / "public-s0.json"),
        )
        _wait_file(tmp_path / "public-s0.json", s0, logs / "public-s0.log", 120)

        for proc, name in [(homes[0], "home1"), (homes[1], "home2"), (s0, "public-s0")]:
            try:
                proc.wait(timeout=360)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish; log:\n{(logs / f'{name}.log').read_text()[-4000:]}")
            assert proc.returncode == 0, (logs / f"{name}.log").read_text()[-4000:]
        s1.terminate()
        s1.wait(timeout=60)

    stats = {
        json.loads(p.read_text())["peer_id"]: json.loads(p.read_text()) for p in (tmp_path / "nodes").glob("*.json")
    }
    home_ids = [i["peer_id"] for i in infos]
    for peer in home_ids:
        s = stats[peer]
        mb = s["microbatches"]
        partners = [h.get("partner") for h in s["outer_history"] if h.get("outcome") == "paired"]
        print(
            f"home {peer[-8:]}: reach {s['transport']['reach']}, bytes by path {s['transport']['bytes_by_path']}, "
            f"microbatches {mb}, losses {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}, partners "
            f"{[p[-8:] if p else p for p in partners]}"
        )
        assert mb["issued"] == mb["completed"] + mb["dropped"] and mb["dropped"] == 0, mb
        assert s["inner_steps"] == STEPS
        assert sum(s["losses"][-4:]) / 4 < sum(s["losses"][:4]) / 4, s["losses"]
        assert partners, s["outer_history"]
        libp2p_bytes = sum(sum(v.values()) for path, v in s["transport"]["bytes_by_path"].items() if path != "direct")
        assert libp2p_bytes > 0, s["transport"]
    paired_with = {
        p: {h.get("partner") for h in stats[p]["outer_history"] if h.get("outcome") == "paired"} for p in home_ids
    }
    assert home_ids[1] in paired_with[home_ids[0]] or home_ids[0] in paired_with[home_ids[1]], paired_with
    # The public joiner copied its state while the homes trained on, so it starts rounds behind a
    # pair in step (sync/partner_search.py draws it too); how often it pairs follows the load on the
    # machine (3 of 6 alone, 0 of 7 beside other tests), so it is shown, not asserted: the unit tests
    # of sync/catch_up.py assert the mechanism.
    public_s0 = next(s for p, s in stats.items() if p not in home_ids and s.get("stage") == 0)
    print("public stage-0 joiner's rounds:", [(h["outcome"], h.get("reason")) for h in public_s0["outer_history"]])
    # Home to home runs through the bootstrap's relay splice, and it is not capped the way p2pd's
    # circuits are (128 KiB per direction): together the homes moved more than that through it.
    relayed = [stats[p]["transport"]["bytes_by_path"].get("relayed", {}) for p in home_ids]
    assert sum(r.get("out", 0) for r in relayed) > 2 * 131072, relayed


def _setup(tmp_path: Path, **extra) -> tuple[Path, Path]:
    overrides = tiny_overrides(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "timeouts.rpc_s": 15.0,
            "timeouts.microbatch_s": 20.0,
            "timeouts.startup_s": 40.0,
            "timeouts.relay_s": 30.0,
            "log.progress": "off",
            **extra,
        },
    )
    prepare_tokenizer(overrides)
    config = tmp_path / "run.toml"
    config.write_text(_toml(overrides))
    (tmp_path / "logs").mkdir()
    return config, tmp_path / "logs"


class _Procs:
    """Starts `noloco-node` commands in the topology's namespaces (which ends them all on close)."""

    def __init__(self, topo: NatTopology, logs: Path) -> None:
        self.topo, self.logs = topo, logs

    def start(self, ns: str, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        return self.topo.run(
            ns, [sys.executable, "-m", "noloco_node", *argv], stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)
        )

    def in_public(self, argv: list[str]) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", self.topo.public, *argv], capture_output=True, text=True, timeout=60, cwd=str(ROOT)
        ).stdout

    def status(self, config: Path, maddr: str) -> dict:
        out = self.in_public(
            [sys.executable, "-m", "noloco_node", "status", "--json", "--config", str(config), "--initial-peers", maddr]
        )
        return {r["peer_id"]: r for r in json.loads(out)["replicas"]}

    def bootstrap(self, config: Path, tmp_path: Path) -> str:
        boot = self.start_bootstrap(config, tmp_path)
        return _wait_file(tmp_path / "maddr", boot, self.logs / "bootstrap.log", 60)["text"].split()[0]

    def start_bootstrap(self, config: Path, tmp_path: Path, name: str = "bootstrap") -> subprocess.Popen:
        """The public bootstrap on port 31330 with its identity in tmp_path (the same one again on a restart)."""
        (tmp_path / "maddr").unlink(missing_ok=True)
        return self.start(
            self.topo.public,
            name,
            "bootstrap",
            "--config",
            str(config),
            "--host",
            self.topo.public_ip,
            "--port",
            "31330",
            "--identity",
            str(tmp_path / "boot.key"),
            "--maddr-file",
            str(tmp_path / "maddr"),
        )

    def finish(self, proc: subprocess.Popen, name: str, timeout_s: float) -> None:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish; log:\n{(self.logs / f'{name}.log').read_text()[-4000:]}")
        assert proc.returncode == 0, (self.logs / f"{name}.log").read_text()[-4000:]


def _stats(nodes: Path) -> dict:
    return {json.loads(p.read_text())["peer_id"]: json.loads(p.read_text()) for p in nodes.glob("*.json")}


@pytest.mark.skipif(NO_NAT is not None, reason=f"no NAT topology here: {NO_NAT}")
def test_only_the_bootstrap_public_a_home_serves_stage_1_and_another_home_trains_through_it(tmp_path):
    steps = 10
    config, logs = _setup(
        tmp_path, **{"outer.method": "noloco", "outer.inner_steps_per_outer": 4, "inner.total_steps": steps}
    )
    nodes = tmp_path / "nodes"
    with NatTopology() as topo:
        procs = _Procs(topo, logs)
        maddr = procs.bootstrap(config, tmp_path)
        # Exactly what a volunteer types: nothing about the network. The first one is the only
        # replica of anything, so no other node exists to check its address.
        common = ["--config", str(config), "--initial-peers", maddr, "--out", str(nodes)]
        home1 = procs.start(
            topo.homes[0], "home1", "join", *common, "--stage", "1", "--ready-file", str(tmp_path / "home1.json")
        )
        info = _wait_file(tmp_path / "home1.json", home1, logs / "home1.log", 180)
        print("\nhome1 ready:", {k: info[k] for k in ("stage", "address", "reach", "p2p_addrs")})
        assert info["stage"] == 1 and info["reach"] in ("holepunched", "relayed"), info
        assert any("p2p-circuit" in a for a in info["p2p_addrs"]), info
        host, _, port = info["address"].rpartition(":")
        assert not _dialable(procs.in_public, host, int(port)), f"{info['address']} is dialable from the public side"
        record = procs.status(config, maddr)[info["peer_id"]]
        assert record["reach"] in ("holepunched", "relayed"), record

        home2 = procs.start(
            topo.homes[1],
            "home2",
            "join",
            *common,
            "--stage",
            "auto",
            "--steps",
            str(steps),
            "--ready-file",
            str(tmp_path / "home2.json"),
        )
        info2 = _wait_file(tmp_path / "home2.json", home2, logs / "home2.log", 180)
        assert info2["stage"] == 0 and info2["reach"] in ("holepunched", "relayed"), info2
        procs.finish(home2, "home2", 360)
        record = procs.status(config, maddr)[info["peer_id"]]
        assert record["reach"] in ("holepunched", "relayed"), record  # after training too: never direct
        home1.terminate()
        home1.wait(timeout=60)

    stats = _stats(nodes)
    trainer, server = stats[info2["peer_id"]], stats[info["peer_id"]]
    mb = trainer["microbatches"]
    print(
        f"home2: {trainer['inner_steps']} steps, microbatches {mb}, losses {trainer['losses'][0]:.3f} -> "
        f"{trainer['losses'][-1]:.3f}; home1 reach {server['transport']['reach']}, bytes by path "
        f"{server['transport']['bytes_by_path']}"
    )
    assert trainer["inner_steps"] == steps and mb["completed"] >= steps, mb
    assert server["transport"]["reach"] != "direct", server["transport"]
    # One step per batch the trainer issued; a microbatch re-issued after its first attempt was
    # computed anyway counts twice here (two per batch), as test_demo_noloco's bound allows.
    assert steps <= server["inner_steps"] <= steps + (mb["reissued"] + 1) // 2, (server["inner_steps"], mb)
    # Every activation and gradient between the two homes crossed the bootstrap's relay splice.
    assert server["transport"]["bytes_by_path"].get("relayed", {}).get("in", 0) > 0, server["transport"]
    assert "direct" not in server["transport"]["bytes_by_path"], server["transport"]


@pytest.mark.skipif(NO_NAT is not None, reason=f"no NAT topology here: {NO_NAT}")
def test_a_relayed_node_moves_to_direct_once_its_router_forwards_its_port(tmp_path):
    # Training must outlast the re-probe's backoff (doubling from 1 s to 16 s): each pass holds its
    # compute thread 50 ms, so 40 steps take well over 16 s (unpaced, they took 3 s and ended first).
    steps, port = 40, 31340
    config, logs = _setup(
        tmp_path, **{"network.reprobe_s": 1.0, "inner.total_steps": steps, "faults.compute_delay_s": 0.05}
    )
    nodes = tmp_path / "nodes"
    with NatTopology() as topo:
        procs = _Procs(topo, logs)
        maddr = procs.bootstrap(config, tmp_path)
        boot_id = maddr.rsplit("/p2p/", 1)[1]
        wan = topo.router_wan_ips[0]
        common = ["--config", str(config), "--initial-peers", maddr, "--out", str(nodes)]
        # Announces its router's address before the router forwards anything: the bootstrap, the
        # only other peer, is asked and cannot reach it.
        home = procs.start(
            topo.homes[0],
            "home1",
            "join",
            *common,
            "--stage",
            "1",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--announce-addr",
            f"{wan}:{port}",
            "--ready-file",
            str(tmp_path / "home1.json"),
        )
        info = _wait_file(tmp_path / "home1.json", home, logs / "home1.log", 180)
        assert info["reach"] in ("holepunched", "relayed") and info["address"] == f"{wan}:{port}", info
        log_text = (logs / "home1.log").read_text()
        assert f"peers cannot reach {wan}:{port}: {boot_id[-8:]}:" in log_text, log_text[-3000:]
        assert not _dialable(procs.in_public, wan, port)

        # A public stage-0 node trains through it, over libp2p (the only way: the address is closed).
        s0 = procs.start(
            topo.public,
            "public-s0",
            "join",
            *common,
            "--stage",
            "0",
            "--host",
            topo.public_ip,
            "--steps",
            str(steps),
            "--ready-file",
            str(tmp_path / "public-s0.json"),
        )
        _wait_step(tmp_path / "public-s0.json", s0, logs / "public-s0.log", 3, 180)

        topo.forward_port(1, port)  # while it trains
        assert _dialable(procs.in_public, wan, port)
        deadline = time.monotonic() + 90
        while json.loads((tmp_path / "home1.json").read_text())["reach"] != "direct":
            assert home.poll() is None and time.monotonic() < deadline, (logs / "home1.log").read_text()[-4000:]
            time.sleep(0.5)
        switched_at = json.loads((tmp_path / "public-s0.json").read_text())["inner_step"]
        assert s0.poll() is None and switched_at < steps, "the switch came after training ended"
        log_text = (logs / "home1.log").read_text()
        # Asked: the public replica (a direct one, first) and the bootstrap.
        assert re.search(rf"peers .*{boot_id[-8:]}.* reached {wan}:{port}", log_text), log_text[-3000:]
        # The DHT is eventually consistent: the record that says direct follows the switch within
        # a heartbeat or two; until then the swarm must still list the node (its relayed record).
        deadline = time.monotonic() + 30
        while (record := procs.status(config, maddr)[info["peer_id"]])["reach"] != "direct":
            assert time.monotonic() < deadline, record
            time.sleep(1.0)
        print(
            f"\nafter the port forward (public-s0 at inner step {switched_at}):",
            {k: record[k] for k in ("address", "reach")},
        )
        assert record["reach"] == "direct" and record["address"] == f"{wan}:{port}", record
        procs.finish(s0, "public-s0", 300)
        home.terminate()
        home.wait(timeout=60)

    stats = _stats(nodes)
    trainer = stats[json.loads((tmp_path / "public-s0.json").read_text())["peer_id"]]
    mb = trainer["microbatches"]
    print("public-s0 bytes by path:", trainer["transport"]["bytes_by_path"], "microbatches:", mb)
    assert trainer["inner_steps"] == steps and mb["completed"] >= steps, mb
    # After the switch it dialled the home node directly (TLS to the forwarded port).
    assert trainer["transport"]["bytes_by_path"].get("direct", {}).get("out", 0) > 0, trainer["transport"]
    assert stats[info["peer_id"]]["transport"]["reach"] == "direct"


def _wait_step(ready: Path, proc: subprocess.Popen, log: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or json.loads(ready.read_text())["inner_step"] < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"{ready.name}: inner step {step} not reached (exit {proc.poll()}); log:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.2)
