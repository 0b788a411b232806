"""Chaos and lies: a D=3 x P=2 swarm trains through a node killed and restarted every few
seconds; a replica that sends poisoned outer snapshots every round never moves an honest one
beyond its solo step."""

import math
import re

import pytest
import torch
from safetensors.torch import load_file

from noloco_node.experiments.chaos import ChaosMonkey, ChaosProfile
from noloco_node.runtime.events import read_events

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_chaos_kill_and_restart_keeps_training_accounted(tmp_path, make_swarm):
    steps, replicas = 60, 3
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 4,
            "inner.total_steps": steps,
            "checkpoint.every_steps": 1,
            # Every restart resumes its own checkpoint, however far its fellows got meanwhile.
            "checkpoint.behind_rounds": 1000,
            "timeouts.match_s": 2.0,
            "timeouts.microbatch_s": 4.0,
            "timeouts.rpc_s": 4.0,
            "timeouts.drain_s": 2.0,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)

    def node_args(stage, replica):
        return (
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt' / f'{stage}-{replica}'}",
            "--events",
            str(tmp_path / "events" / f"{stage}-{replica}.jsonl"),
            "--save-weights",
        )

    servers = [swarm.start_node(1, r, *node_args(1, r)) for r in range(replicas)]
    swarm.wait_ready(servers)
    drivers = [swarm.start_node(0, r, "--steps", str(steps), *node_args(0, r)) for r in range(replicas)]
    swarm.wait_ready(drivers)

    def has_checkpoint(node):  # "restarted from its checkpoint" needs one to exist first
        return (tmp_path / "ckpt" / f"{node.stage}-{node.replica}" / f"stage{node.stage}.json").exists()

    with ChaosMonkey(swarm, ChaosProfile(action="kill", every_s=4.0), seed=3, eligible=has_checkpoint) as monkey:
        monkey.wait_for_drivers(replicas, timeout_s=330)
    kills = [e for e in monkey.events if e["action"] == "kill"]
    failed = [e for e in monkey.events if "failed" in e["action"]]
    assert len(kills) >= 3 and not failed, monkey.events
    assert all(n.proc.returncode == 0 for n in swarm.nodes if n.stage == 0), [n.proc.returncode for n in swarm.nodes]
    swarm.stop()

    stats = swarm.node_stats()
    # A driver killed after its last step but before it exited wrote its stats and then came
    # back (resumed at that step) under a new peer id: the last incarnation is the one to check.
    last_drivers = [n for n in swarm.nodes if n.stage == 0]
    final_drivers = [stats[n.info["peer_id"]] for n in last_drivers]
    assert [s["inner_steps"] for s in final_drivers] == [steps] * replicas, {
        p[-6:]: (s["stage"], s["inner_steps"]) for p, s in stats.items()
    }
    for s in final_drivers:
        mb = s["microbatches"]
        assert mb["issued"] == mb["completed"] + mb["dropped"], mb
        assert all(math.isfinite(x) for x in s.get("losses", []))  # none if restarted at its last step
    for s in stats.values():
        assert s["saved_inputs"] == 0 or s["stage"] == 0

    for stage in (0, 1):
        for r in range(replicas):
            label = f"stage{stage}/replica{r}"
            events = read_events(tmp_path / "events" / f"{stage}-{r}.jsonl")
            started = [e for e in events if e["event"] == "started"]
            # A restart that resumed a checkpoint rounds behind its stage copies the stage's state
            # again (node/catching_up.py): a start, then `moved` to its own stage (stages are pinned).
            recopies = [e for e in events if e["event"] == "moved"]
            assert all(e["why"] == "behind" and e["from"] == e["to"] == stage for e in recopies), recopies
            restarts = [e for e in started[1:] if not any(0 <= m["ts"] - e["ts"] < 1.0 for m in recopies)]
            killed = sum(1 for e in kills if e["node"] == label)
            assert len(started) == 1 + killed + len(recopies), (label, len(started), killed, len(recopies))
            assert len(restarts) == killed, (label, started, recopies)
            assert all(e["resumed_from"] is not None for e in restarts), (label, started)
            for e in restarts:
                assert e["resumed_from"]["inner_step"] >= 1

    for r in range(replicas):
        events = read_events(tmp_path / "events" / f"0-{r}.jsonl")
        losses = [e["loss"] for e in events if e["event"] == "inner_step"]
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, losses
        log_text = (swarm.out_dir / "logs" / f"stage0-r{r}.log").read_text()
        reported = len(re.findall(r"microbatch \d+ dropped", log_text))
        [last] = [n for n in swarm.nodes if n.stage == 0 and n.replica == r]
        final = stats[last.info["peer_id"]]
        assert final["microbatches"]["dropped"] <= reported, "every counted drop must have been reported"

    for path in (swarm.out_dir / "nodes").glob("*.safetensors"):
        for name, tensor in load_file(str(path)).items():
            assert torch.isfinite(tensor).all(), (path.name, name)


def test_poisoned_snapshots_every_round_never_move_an_honest_replica(tmp_path, make_swarm):
    # Three rounds: the first already meets the liar; a later round can wait out the whole window
    # (the liar banned, or gone once it finished), so each extra round cost up to match_s.
    steps = 6
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 2,
            "inner.total_steps": steps,
            # Long enough for the two stage-0 replicas' start skew under CI load. CI once saw every
            # round of both go solo, 0 rejected: the honest one's first lookup missed the liar's
            # record, its round 1 went solo at once and the two stayed a round apart (fixed in
            # dht/directory.py and sync/pairing.py; each round's outcome is in the message below).
            "timeouts.match_s": 8.0,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    servers = [swarm.start_node(1, r) for r in range(2)]  # --wait-replicas counts every stage
    swarm.wait_ready(servers)
    # Two stage-0 replicas step once per batch, so their rounds line up and they try to pair every round.
    honest = swarm.start_node(0, 0, "--steps", str(steps), "--wait-replicas", "2", "--save-weights")
    liar = swarm.start_node(
        0,
        1,
        "--steps",
        str(steps),
        "--wait-replicas",
        "2",
        "--save-weights",
        "--set",
        "faults.inject=send_snapshot:poison%0.5,send_snapshot:poison=1000000",
    )
    swarm.wait_ready([honest, liar])
    swarm.wait_exit([honest, liar], timeout_s=240)
    assert honest.proc.returncode == 0 and liar.proc.returncode == 0
    swarm.stop()
    stats = swarm.node_stats()
    mine = stats[honest.info["peer_id"]]
    theirs = stats[liar.info["peer_id"]]
    history = mine["outer_history"]
    assert len(history) == steps // 2
    assert all(h["outcome"] != "paired" for h in history), history
    rounds = {
        who: [
            (h["round"], h["outcome"], h["reason"], h["proposed_to"], round(h["seconds"], 1))
            for h in s["outer_history"]
        ]
        for who, s in (("honest", mine), ("liar", theirs))
    }
    assert mine["outer"]["rejected"] >= 1 and mine["outer"]["paired"] == 0, (mine["outer"], rounds)
    assert theirs["faults_fired"] and all(f == "send_snapshot:poison" for f in theirs["faults_fired"])
    weights = load_file(
        str(next((swarm.out_dir / "nodes").glob(f"stage0-{honest.info['peer_id'][-8:]}.outer.safetensors")))
    )
    for name, tensor in weights.items():
        assert torch.isfinite(tensor).all() and tensor.abs().max() < 100, name
    assert mine["losses"][-1] < mine["losses"][0]
