"""One bad microbatch must not kill a replica. A hostile peer sends a stage-1 replica, mid-run,
a well-formed Forward whose values are +-3e38 (finite, but the next norm overflows them), and
copies scaled 1e4x and 1e8x over the normal activations' RMS. Each is refused with
INVALID_ARGUMENT, its sender is banned, and the honest run finishes with every microbatch
completed and finite weights. The same replica has NaN gradients forced on two of its steps by a
fault hook: exactly those steps are skipped and counted, and training goes on."""

import json
import time

import grpc
import pytest
import torch
from safetensors.torch import load_file

from noloco_node.runtime.events import read_events
from noloco_node.transport.identity import NodeIdentity
from noloco_node.wire.v1 import stage_pb2_grpc, tensor_pb2

from .clients import secure_channel, signed
from .conftest import prepare_tokenizer, tiny_overrides
from .test_malformed_rpc import FORWARD, forward_messages

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
STEPS = 30


def normal_activation_rms(overrides) -> float:
    """RMS of a real stage-0 output of this run's model at its initial weights."""
    from noloco_node.model.build import build_run_stage, run_model

    config, _, tokenizer = prepare_tokenizer(overrides)
    llama, ranges = run_model(config, len(tokenizer))
    stage = build_run_stage(config, llama, ranges, 0)
    with torch.no_grad():
        out = stage(torch.randint(0, len(tokenizer), (2, config.model.seq_len)))
    return float(out.pow(2).mean().sqrt())


def attack(info: dict, run, values: torch.Tensor, honest: torch.Tensor) -> list[str]:
    """One hostile Forward from a fresh identity, then an honest-looking one from the same
    identity: the codes of both (the second shows whether the first earned a ban)."""
    me = NodeIdentity.generate()
    codes = []
    with secure_channel(info) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        for sequence, payload in ((1, values), (2, honest)):
            try:
                stub.Forward(
                    iter(
                        forward_messages(
                            run,
                            me.peer_id,
                            shape=tuple(payload.shape),
                            values=payload,
                            sequence=sequence,
                            labels=[1] * payload.shape[1],
                        )
                    ),
                    timeout=10,
                    metadata=signed(me, FORWARD, info),
                )
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
    return codes


def test_poisoned_microbatches_are_refused_and_the_replica_stays_healthy(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "inner.total_steps": STEPS,
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 5,
        },
    )
    rms = normal_activation_rms(overrides)
    swarm = make_swarm(overrides)
    events_file = tmp_path / "stage1.events.jsonl"
    target = swarm.start_node(
        1,
        0,
        "--events",
        str(events_file),
        "--save-weights",
        "--set",
        "faults.delay_before_forward_s=0.1",
        "--set",
        "faults.inject=inner_step:poison@7,inner_step:poison@12",
    )
    swarm.wait_ready([target])
    driver = swarm.start_node(0, 0, "--steps", str(STEPS))
    info = target.info
    run = tensor_pb2.RunIdentity(run_id=info["run_id"], manifest_hash=info["manifest_hash"])

    # Mid-run: once stage 1 has stepped 5 times it has accepted 10 honest activations (bounds warm).
    deadline = time.monotonic() + 120
    while not any(e["event"] == "inner_step" and e["inner_step"] >= 5 for e in read_events(events_file)):
        assert time.monotonic() < deadline and driver.proc.poll() is None, "stage 1 never reached inner step 5"
        time.sleep(0.1)
    shape = (1, 16, 32)
    signs = torch.randint(0, 2, shape) * 2.0 - 1.0
    honest = torch.randn(shape) * rms
    results = {
        "+-3e38": attack(info, run, signs * 3e38, honest),
        "1e4 x rms": attack(info, run, torch.randn(shape) * rms * 1e4, honest),
        "1e8 x rms": attack(info, run, torch.randn(shape) * rms * 1e8, honest),
    }
    assert results == {name: ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"] for name in results}, results

    swarm.wait_exit([driver], timeout_s=240)
    assert driver.proc.returncode == 0
    swarm.stop()
    stats = swarm.node_stats()
    [drv] = [s for s in stats.values() if s["stage"] == 0]
    served = stats[info["peer_id"]]
    mb = drv["microbatches"]
    assert drv["inner_steps"] == STEPS and mb["issued"] == mb["completed"] and mb["dropped"] == 0, mb
    assert all(torch.isfinite(torch.tensor(drv["losses"]))) and drv["losses"][-1] < drv["losses"][0]
    integrity = served["integrity"]
    assert integrity["payloads_refused"] == 3 and integrity["skipped_steps"] == 2, integrity
    assert integrity["weights_repaired"] == 0 and integrity["dropped_non_finite"] == 0, integrity
    assert served["admission"]["peers_banned"] == 3
    skipped = [e["inner_step"] for e in read_events(events_file) if e["event"] == "inner_step_skipped"]
    assert skipped == [7, 12], skipped
    [weights] = [p for p in (swarm.out_dir / "nodes").glob("stage1*.safetensors") if ".outer." not in p.name]
    assert all(torch.isfinite(t).all() for t in load_file(str(weights)).values())
    print("\nintegrity:", json.dumps(integrity), "activation rms", round(rms, 4))
