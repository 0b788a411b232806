"""`noloco-node status --json` (the real console script) lists every node of a running swarm."""

import json
import subprocess
import sys

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_status_json_lists_every_node(tmp_path, make_swarm):
    overrides = tiny_overrides(tmp_path, **{"run.run_id": "status-test"})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    nodes = [
        swarm.start_node(1, 0),
        swarm.start_node(1, 1),
        swarm.start_node(0, 0, "--steps", "0"),
    ]  # listed, not training
    swarm.wait_ready(nodes)
    sets = [a for o in overrides for a in ("--set", o)]
    result = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr, "--json", *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    listing = json.loads(result.stdout)
    assert listing["schema"] == "noloco-node/swarm/1" and listing["run"]["run_id"] == "status-test"  # docs/dashboard.md
    found = {(r["peer_id"], r["stage"], r["address"]) for r in listing["replicas"]}
    assert found == {(n.info["peer_id"], n.stage, n.info["address"]) for n in nodes}
    assert all(r["status"] == "serving" and r["run_id"] == "status-test" for r in listing["replicas"])
    # Every replica publishes its memory: the start-up estimate and the peak it has measured since.
    assert all(r["memory_estimate_bytes"] > 0 and r["memory_peak_bytes"] > 0 for r in listing["replicas"]), listing

    table = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr, *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0 and "3 replicas over 2 stages" in table.stdout

    # Without the swarm's config (the README's `status --initial-peers MADDR`): run 'local' has no
    # node, and status says which run the swarm serves instead of inviting a join of an empty stage.
    bare = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bare.returncode == 0, bare.stderr[-2000:]
    assert "run local: 0 replicas" in bare.stdout
    assert "! the swarm's peers serve run 'status-test'; this config's run is 'local'" in bare.stdout, bare.stdout
    assert "has no replica" not in bare.stdout
