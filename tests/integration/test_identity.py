"""Proven identities: a peer whose DHT record claims another node's peer id (signed with its own
key, pointing at another address) is refused by every honest peer and counted, the honest node
it impersonates is never banned because of it, and `status` lists only the real one."""

import json
import subprocess
import sys
import time

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_record_claiming_another_peer_id_is_refused_and_the_victim_never_banned(tmp_path, make_swarm):
    steps = 6
    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 2, "inner.total_steps": steps})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    victim = swarm.start_node(1, 0)
    swarm.wait_ready([victim])
    info = victim.info
    ready = tmp_path / "impostor.ready"
    impostor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.impostor",
            "--initial-peers",
            swarm.maddr,
            "--victim",
            info["peer_id"],
            "--run-id",
            info["run_id"],
            "--manifest-hash",
            info["manifest_hash"],
            "--stage",
            "1",
            "--num-stages",
            "2",
            "--ready-file",
            str(ready),
            "--seconds",
            "240",
        ],
        stdout=open(tmp_path / "impostor.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert impostor.poll() is None and time.monotonic() < deadline, (tmp_path / "impostor.log").read_text()
            time.sleep(0.1)
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "noloco_node",
                "status",
                "--json",
                "--initial-peers",
                swarm.maddr,
                *sum((["--set", o] for o in overrides), []),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr
        listed = [r for r in json.loads(status.stdout)["replicas"] if r["stage"] == 1]
        assert [(r["peer_id"], r["address"]) for r in listed] == [(info["peer_id"], info["address"])], listed

        driver = swarm.start_node(0, 0, "--steps", str(steps))
        swarm.wait_exit([driver], timeout_s=180)
        assert driver.proc.returncode == 0
    finally:
        impostor.kill()
        impostor.wait(timeout=10)
    swarm.stop()
    stats = swarm.node_stats()
    [drv] = [s for s in stats.values() if s["stage"] == 0]
    served = stats[info["peer_id"]]
    mb = drv["microbatches"]
    print(
        f"\nimpostor records refused: driver {drv['transport']['impostor_records']}, "
        f"victim {served['transport']['impostor_records']}; microbatches {mb}"
    )
    assert drv["inner_steps"] == steps and mb["issued"] == mb["completed"] and mb["dropped"] == 0
    assert drv["transport"]["impostor_records"] >= 1
    assert served["transport"]["impostor_records"] >= 1
    assert info["peer_id"] not in drv["routing_bans"], drv["routing_bans"]
    assert served["forwards_received"] and set(served["forwards_received"]) == {drv["peer_id"]}
