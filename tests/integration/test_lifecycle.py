"""The volunteer's lifecycle through the real console script: an unreachable bootstrap peer,
`join --stage auto` (alone and two at once), `doctor` against a live swarm (passing, and failing with the right exit
code), graceful shutdown on SIGTERM, and the JSONL event stream."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from noloco_node.experiments.process_group import ProcessGroup
from noloco_node.runtime.events import read_events

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def cli(overrides, *args, timeout=120):
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", "noloco_node", args[0], *sets, *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_side_by_side(tmp_path, *calls: tuple, timeout_s: float = 150) -> list[subprocess.CompletedProcess]:
    """`noloco-node` commands run at once, each (overrides, *args), forked from the zygote that has
    done their imports (ProcessGroup), with their output in files: the doctor's checks only read the
    swarm, so they need not wait for each other. Returns their results in the order given; whatever
    still runs when this returns or fails is stopped."""
    group, started = ProcessGroup(), []
    try:
        for i, (overrides, *args) in enumerate(calls):
            sets = [a for o in overrides for a in ("--set", o)]
            out, err = tmp_path / f"cli{i}.out", tmp_path / f"cli{i}.err"
            with open(out, "w") as stdout, open(err, "w") as stderr:
                cmd = [sys.executable, "-m", "noloco_node", args[0], *sets, *args[1:]]
                started.append((cmd, group.spawn(cmd, stdout=stdout, stderr=stderr), out, err))
        deadline = time.monotonic() + timeout_s
        return [
            subprocess.CompletedProcess(
                cmd, proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.read_text(), err.read_text()
            )
            for cmd, proc, out, err in started
        ]
    finally:
        group.drain(grace_s=5)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_unreachable_bootstrap_fails_within_the_startup_timeout(tmp_path):
    overrides = tiny_overrides(tmp_path, **{"timeouts.startup_s": 5.0})
    maddr = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/12D3KooWC9iPeg5yx8MPKDydmEzZbFyDDQL3AanYS6yEd9h7uLMW"
    start = time.monotonic()
    result = cli(overrides, "join", "--stage", "1", "--initial-peers", maddr)
    elapsed = time.monotonic() - start
    print(f"unreachable bootstrap: exit {result.returncode} after {elapsed:.1f} s (startup_s 5)")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "could not join the DHT" in result.stderr and maddr in result.stderr and "fix:" in result.stderr
    # A loopback address names this machine: the fix says so (a NAT audit's volunteer copied the
    # bootstrap's 127.0.0.1 line to their own machine and read only "the exact multiaddr it printed").
    assert "127.0.0.1 is this machine" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    # startup_s plus process start-up and imports (generous: the CI machine is a shared 2-core box,
    # where imports alone took 40 s in a run loaded four processes deep); a hang would run to the timeout.
    assert elapsed < 5.0 + 60.0


def test_stage_auto_and_doctor_against_a_live_swarm(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path, **{"run.run_id": "doctor-test", "outer.method": "noloco", "outer.inner_steps_per_outer": 1000}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    # Stage-0 nodes here only serve (and donate state): no training load while the checks below run,
    # and no capacity measured yet, so `auto` goes by replica counts.
    idle = ("--steps", "0")
    donor, *stage1 = nodes = [swarm.start_node(0, 0, *idle), swarm.start_node(1, 0), swarm.start_node(1, 1)]
    swarm.wait_ready(nodes)

    # Replicas per stage are [1, 2]: auto picks stage 0 and copies the donor's state.
    auto = swarm.start_node("auto", 1, *idle)
    swarm.wait_ready([auto])
    assert auto.info["stage"] == 0

    # Two volunteers at the same instant into [2, 2]: alone, each would take stage 0 (fewest
    # replicas, lowest index); their claims make them agree on one each.
    pair = [swarm.start_node("auto", 2, *idle), swarm.start_node("auto", 3, *idle)]
    swarm.wait_ready(pair)
    assert sorted(n.info["stage"] for n in pair) == [0, 1]

    closed = closed_port()  # an announced address nobody listens on (the NAT / firewall case)
    direct = overrides + ["network.reach=direct"]  # the node must be dialled directly
    taken = int(stage1[0].info["address"].rsplit(":", 1)[1])  # a port a running node holds
    ok, unreached, unreached_direct, port_taken, other_manifest, join_unreached = cli_side_by_side(
        tmp_path,
        (overrides, "doctor", "--initial-peers", swarm.maddr),
        (overrides, "doctor", "--initial-peers", swarm.maddr, "--announce-addr", f"127.0.0.1:{closed}"),
        (direct, "doctor", "--initial-peers", swarm.maddr, "--announce-addr", f"127.0.0.1:{closed}"),
        (overrides, "doctor", "--initial-peers", swarm.maddr, "--port", str(taken)),
        (overrides + ["model.hidden_size=64"], "doctor", "--initial-peers", swarm.maddr),
        (direct, "join", "--stage", "1", "--initial-peers", swarm.maddr, "--announce-addr", f"127.0.0.1:{closed}"),
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
    for check in ("python", "port", "dht", "reach", "clock", "compat"):
        assert f"[ok  ] {check}" in ok.stdout, ok.stdout

    # By default (network.reach = auto) an unreachable announced address is no failure, only
    # information: the node will be reached over libp2p instead.
    assert unreached.returncode == 0, unreached.stdout + unreached.stderr[-2000:]
    assert f"[info] reach   no peer could reach 127.0.0.1:{closed}" in unreached.stdout
    assert "libp2p" in unreached.stdout
    # With network.reach = direct the reach check fails.
    assert unreached_direct.returncode == 14, unreached_direct.stdout + unreached_direct.stderr[-2000:]
    assert f"no peer could reach 127.0.0.1:{closed}" in unreached_direct.stdout
    assert "--announce-addr" in unreached_direct.stdout

    # A port already taken: the port check fails.
    assert port_taken.returncode == 12, port_taken.stdout + port_taken.stderr[-2000:]
    assert "cannot bind" in port_taken.stdout

    # Another config (so another manifest): the compat check fails and names the fix.
    assert other_manifest.returncode == 16, other_manifest.stdout + other_manifest.stderr[-2000:]
    assert "manifest" in other_manifest.stdout and "--config" in other_manifest.stdout

    # A node that must be dialled directly but announces an unreachable address is refused at join,
    # with exit 4. (With reach = auto it would serve over libp2p.)
    assert join_unreached.returncode == 4, join_unreached.stderr[-2000:]
    assert "no peer could reach this node" in join_unreached.stderr and "--announce-addr" in join_unreached.stderr

    swarm.terminate(auto.proc)
    stats = swarm.node_stats()[auto.info["peer_id"]]
    assert stats["stage"] == 0 and stats["fetched_state"]["donor"] == donor.info["peer_id"]


def test_sigterm_drains_withdraws_checkpoints_and_exits_0(tmp_path, make_swarm):
    ckpt, events = tmp_path / "ckpt", tmp_path / "events.jsonl"
    overrides = tiny_overrides(tmp_path, **{"run.run_id": "shutdown-test", "checkpoint.every_steps": 1000})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    leaver = swarm.start_node(1, 0, "--set", f"checkpoint.dir={ckpt}", "--events", str(events))
    stayer = swarm.start_node(1, 1)
    swarm.wait_ready([leaver, stayer])
    driver = swarm.start_node(0, 0, "--steps", "40")
    swarm.wait_ready([driver])

    wait_for(lambda: json.loads(leaver.ready_file.read_text())["inner_step"] >= 3, 120, "the leaver to train")
    leaver.proc.send_signal(signal.SIGTERM)
    assert leaver.proc.wait(timeout=60) == 0
    swarm.wait_exit([driver], timeout_s=180)

    stats = swarm.node_stats()
    mine = stats[leaver.info["peer_id"]]
    assert mine["saved_inputs"] == 0 and mine["in_flight"] == 0
    meta = json.loads((ckpt / "stage1.json").read_text())
    assert meta["inner_step"] == mine["inner_steps"] and (ckpt / meta["file"]).exists()
    kinds = [e["event"] for e in read_events(events)]
    assert kinds[0] == "started" and kinds[-2:] == ["checkpoint", "stopped"] and "stopping" in kinds
    assert kinds.count("inner_step") == mine["inner_steps"]
    assert all(e["peer"] == leaver.info["peer_id"] and e["stage"] == 1 for e in read_events(events))
    # Nothing the leaver held was lost: the run finished on the other replica without drops.
    counters = stats[driver.info["peer_id"]]["microbatches"]
    assert counters["dropped"] == 0 and counters["issued"] == counters["completed"]

    listing = json.loads(cli(overrides, "status", "--initial-peers", swarm.maddr, "--json").stdout)
    statuses = {r["peer_id"]: r["status"] for r in listing["replicas"]}
    assert statuses.get(leaver.info["peer_id"], "leaving") == "leaving"
    assert statuses[stayer.info["peer_id"]] == "serving"
