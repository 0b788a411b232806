"""A replica that joins a stage late fetches a live replica's state over Outer.FetchState and then
holds exactly the donor's phi, momentum, Adam moments and counters, with theta = phi."""

import json
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def load_outer(path):
    with safe_open(str(path), "pt") as f:
        counters = json.loads(f.metadata()["counters"])
    return load_file(str(path)), counters


def test_late_joiner_copies_the_donor(tmp_path, make_swarm):
    steps = 15
    overrides = tiny_overrides(tmp_path, **{"outer.method": "noloco", "outer.inner_steps_per_outer": 5,
                                            "inner.total_steps": steps, "timeouts.match_s": 1.0})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    donor = swarm.start_node(1, 0, "--save-weights")
    swarm.wait_ready([donor])
    driver = swarm.start_node(0, 0, "--steps", str(steps))
    swarm.wait_exit([driver], timeout_s=200)
    assert driver.proc.returncode == 0
    deadline = time.monotonic() + 60
    while True:  # the donor's last outer round (at step 15) has finished: its state is now fixed
        status = json.loads(donor.ready_file.read_text())
        if status["inner_step"] == steps and status["outer_round"] == steps // 5 + 1 and status["status"] == "serving":
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    joiner = swarm.start_node(1, 1, "--save-weights")
    swarm.wait_ready([joiner])
    swarm.stop()

    nodes = swarm.out_dir / "nodes"
    stats = swarm.node_stats()
    donor_id, joiner_id = donor.info["peer_id"], joiner.info["peer_id"]
    assert stats[joiner_id]["fetched_state"]["donor"] == donor_id
    assert stats[joiner_id]["inner_steps"] == stats[donor_id]["inner_steps"] == steps
    d_outer, d_counters = load_outer(next(nodes.glob(f"stage1-{donor_id[-8:]}.outer.safetensors")))
    j_outer, j_counters = load_outer(next(nodes.glob(f"stage1-{joiner_id[-8:]}.outer.safetensors")))
    assert set(d_outer) == set(j_outer) and any(k.startswith("adam_exp_avg/") for k in d_outer)
    for name, tensor in d_outer.items():
        assert torch.equal(j_outer[name], tensor), name
    assert j_counters == d_counters
    joiner_theta = load_file(str(next(nodes.glob(f"stage1-{joiner_id[-8:]}.safetensors"))))
    for name, theta in joiner_theta.items():
        assert torch.equal(theta, d_outer[f"phi/{name}"].to(theta.dtype)), name
