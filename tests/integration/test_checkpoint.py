"""A node killed with SIGKILL and restarted resumes from its last checkpoint: the same weights,
slow weights, momentum, Adam state and counters as saved, and it is back in `status` within 30 s."""

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_sigkill_and_restart_resumes_from_checkpoint(tmp_path, make_swarm):
    steps, ckpt = 6, tmp_path / "ckpt"
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 3,
            "timeouts.match_s": 1.0,
            "checkpoint.every_steps": 2,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0, "--set", f"checkpoint.dir={ckpt}")
    swarm.wait_ready([node])
    driver = swarm.start_node(0, 0, "--steps", str(steps))
    swarm.wait_exit([driver], timeout_s=120)
    meta_path = ckpt / "stage1.json"
    deadline = time.monotonic() + 60
    while not (meta_path.exists() and json.loads(meta_path.read_text())["inner_step"] == steps):
        assert time.monotonic() < deadline, "no checkpoint at the last step"
        time.sleep(0.05)
    meta = json.loads(meta_path.read_text())
    saved = load_file(str(ckpt / meta["file"]))
    swarm.kill(node)

    restarted = swarm.start_node(1, 1, "--set", f"checkpoint.dir={ckpt}", "--save-weights")
    restart_time = time.monotonic()
    swarm.wait_ready([restarted])
    sets = [a for o in overrides for a in ("--set", o)]
    while True:
        listing = subprocess.run(
            [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr, "--json", *sets],
            capture_output=True,
            text=True,
            timeout=60,
        )
        peers = {r["peer_id"]: r for r in json.loads(listing.stdout)["replicas"]} if listing.returncode == 0 else {}
        if restarted.info["peer_id"] in peers:
            print(f"back in status {time.monotonic() - restart_time:.1f} s after the restart")
            break
        assert time.monotonic() - restart_time < 30, listing.stderr[-1000:]
    assert peers[restarted.info["peer_id"]]["inner_step"] == steps
    swarm.stop()

    stats = swarm.node_stats()[restarted.info["peer_id"]]
    assert stats["resumed_from"]["inner_step"] == steps and stats["inner_steps"] == steps
    assert stats["fetched_state"] is None  # resumed, did not fetch
    weights = load_file(
        str(next((swarm.out_dir / "nodes").glob(f"stage1-{restarted.info['peer_id'][-8:]}.safetensors")))
    )
    for name, tensor in weights.items():
        assert torch.equal(tensor, saved[f"theta/{name}"]), name
    # The shutdown checkpoint of the restarted node still holds the same phi, m and Adam state.
    after = load_file(str(ckpt / json.loads(meta_path.read_text())["file"]))
    for name, tensor in saved.items():
        assert torch.equal(after[name], tensor), name
