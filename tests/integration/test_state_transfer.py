"""A replica that joins a stage late fetches its state over Outer.FetchState, compactly (phi
exact, m and Adam's moments within their codecs' bounds) and from several replicas at once; a donor
that dies mid-transfer costs only the parameters it had not sent whole."""

import json
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS, H = 10, 5


def load_outer(path):
    with safe_open(str(path), "pt") as f:
        counters = json.loads(f.metadata()["counters"])
    return load_file(str(path)), counters


def assert_compact_copy(got: dict, want: dict) -> None:
    """phi exact; m and exp_avg_sq as bf16 rounds them; exp_avg within int8's absmax / 254 per block."""
    assert set(got) == set(want) and any(k.startswith("adam_exp_avg/") for k in want)
    for name, tensor in want.items():
        if name.startswith("phi/"):
            assert torch.equal(got[name], tensor), name
        elif name.startswith("adam_exp_avg/"):
            blocks = tensor.reshape(-1).split(64)
            bound = torch.cat([torch.full_like(b, float(b.abs().max()) / 254 * (1 + 1e-5)) for b in blocks])
            assert ((got[name] - tensor).reshape(-1).abs() <= bound).all(), name
        else:
            assert torch.allclose(got[name], tensor, rtol=2**-8, atol=0), name


def trained_donor(tmp_path, make_swarm):
    """A swarm whose stage-1 replica (saving its weights on exit) has trained STEPS steps with
    outer rounds every H and no longer changes."""
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": H,
            "inner.total_steps": STEPS,
            "timeouts.match_s": 1.0,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    donor = swarm.start_node(1, 0, "--save-weights")
    swarm.wait_ready([donor])
    driver = swarm.start_node(0, 0, "--steps", str(STEPS))
    swarm.wait_exit([driver], timeout_s=200)
    assert driver.proc.returncode == 0
    deadline = time.monotonic() + 60
    while True:  # the donor's last outer round has finished: its state is now fixed
        status = json.loads(donor.ready_file.read_text())
        if status["inner_step"] == STEPS and status["outer_round"] == STEPS // H + 1 and status["status"] == "serving":
            return swarm, donor
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def saved(swarm, node):
    nodes = swarm.out_dir / "nodes"
    peer = node.info["peer_id"][-8:]
    outer, counters = load_outer(next(nodes.glob(f"stage1-{peer}.outer.safetensors")))
    return outer, counters, load_file(str(next(nodes.glob(f"stage1-{peer}.safetensors"))))


def test_late_joiners_copy_their_donors_and_a_donor_killed_mid_transfer_costs_only_its_part(tmp_path, make_swarm):
    """A late joiner copies the one trained replica (the second donor below); a third replica then
    splits the stage between the two, the second dies (exit 17) after sending three parameters, and
    the joiner keeps those and takes the rest from the first. Its phi and theta are then the donors'
    phi, its counters theirs and its Adam moments theirs within the compact codecs' bounds."""
    swarm, first = trained_donor(tmp_path, make_swarm)
    # Pauses 0.3 s before its third parameter (the two before it reach the joiner; under the
    # transfer's own deadline), dies before the fourth.
    dying = swarm.start_node(1, 1, "--set", "faults.inject=donate_parameter:delay=0.3@3,donate_parameter:crash@4")
    swarm.wait_ready([dying])
    joiner = swarm.start_node(1, 2, "--save-weights")
    swarm.wait_ready([joiner])
    dying.proc.wait(timeout=30)
    swarm.stop()

    assert dying.proc.returncode == 17  # runtime/faults.py: crash
    first_id, dying_id, joiner_id = first.info["peer_id"], dying.info["peer_id"], joiner.info["peer_id"]
    fetched = swarm.node_stats()[joiner_id]["fetched_state"]
    assert fetched["failed"] == [dying_id], fetched
    kept = fetched["donors"][dying_id]
    assert 2 <= kept <= 3 and fetched["reasked"] > 0, fetched
    d_outer, d_counters, _ = saved(swarm, first)
    j_outer, j_counters, joiner_theta = saved(swarm, joiner)
    assert kept + fetched["donors"][first_id] == sum(k.startswith("phi/") for k in d_outer)
    for name, tensor in d_outer.items():
        if name.startswith("phi/"):
            assert torch.equal(j_outer[name], tensor), name
    assert j_counters == d_counters and j_counters["inner_step"] == STEPS
    assert_compact_copy(j_outer, d_outer)
    for name, theta in joiner_theta.items():
        assert torch.equal(theta, d_outer[f"phi/{name}"].to(theta.dtype)), name


def test_a_joiner_whose_copy_lands_rounds_behind_tops_it_up_and_pairs(tmp_path, make_swarm):
    """The joiner's copy is held up 6 s after the manifest (a slow home uplink, in short) while the
    donor trains on at ~0.1 s per step with H = 4: without a top-up it starts ~10 rounds behind,
    past the catch-up's 2, and pairs with nobody. It tops its phi up from the donor (the
    difference since the copy, int8) and takes its counters, so it starts level and pairs."""
    h = 4
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": h,
            "inner.total_steps": 2000,
            "timeouts.match_s": 3.0,
            "faults.compute_delay_s": 0.03,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    donor = swarm.start_node(1, 0)
    swarm.wait_ready([donor])
    driver = swarm.start_node(0, 0, "--steps", "2000")
    swarm.wait_ready([driver])
    joiner = swarm.start_node(1, 1, "--set", "faults.inject=during_state_transfer:delay=6@1")
    swarm.wait_ready([joiner])
    deadline = time.monotonic() + 90
    while True:  # six of the joiner's rounds, or its time is up
        status = json.loads(joiner.ready_file.read_text())
        if status["outer_round"] >= joiner.info["outer_round"] + 6 or time.monotonic() > deadline:
            break
        assert driver.proc.poll() is None and joiner.proc.poll() is None
        time.sleep(0.2)
    swarm.stop()

    stats = swarm.node_stats()
    joiner_stats = stats[joiner.info["peer_id"]]
    fetched = joiner_stats["fetched_state"]
    rounds = [(h_["outcome"], h_.get("reason")) for h_ in joiner_stats["outer_history"]]
    print(f"\nfetched {fetched}\njoiner's rounds {rounds}")
    assert fetched["topped_up"] is not None and fetched["topped_up"] >= 2 * h, fetched
    assert any(outcome == "paired" for outcome, _ in rounds), rounds
