"""The trained model out: node checkpoints of every stage become a standard Hugging Face model
directory (`noloco-node export --from-checkpoint`) that plain `transformers` loads offline, whose
logits equal the stages chained, with `--average` the mean of the replicas' phi; `eval` and
`generate` run on it."""

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from noloco_node.node import checkpoint
from noloco_node.cli.main import main
from noloco_node.config import load_config
from noloco_node.node.manifest import load_run_inputs
from noloco_node.model.build import build_run_stage, run_model
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def cli(overrides, *args, timeout=180):
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", "noloco_node", args[0], *args[1:], *sets],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _replica_checkpoint(config, llama, ranges, stage_index, directory, manifest_hash, shift):
    """A node's checkpoint whose phi differs from its theta and from the other replica's phi."""
    stage = build_run_stage(config, llama, ranges, stage_index)
    outer = OuterState(stage.named_parameters(), alpha=0.5, beta=0.7)
    with torch.no_grad():
        for name, phi in outer.phi.items():
            phi.add_(shift * torch.randn_like(phi, generator=torch.Generator().manual_seed(len(name))))
        for p in stage.parameters():
            p.mul_(0.5)  # theta: something else again, so an export of theta would be caught
    inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-3, warmup_steps=1, total_steps=10))
    tensors, counters = checkpoint.collect(stage, inner, outer)
    checkpoint.save(
        directory,
        stage_index,
        tensors,
        counters,
        {"run_id": config.run.run_id, "manifest_hash": manifest_hash, "peer_id": f"r{shift}"},
    )
    return {n: t.clone() for n, t in outer.phi.items()}


def test_export_from_checkpoints_loads_in_transformers_and_matches_the_stages(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 2, "data.holdout_fraction": 0.05})
    config, _, tokenizer = prepare_tokenizer(overrides)
    _, _, manifest_hash = load_run_inputs(config)
    llama, ranges = run_model(config, len(tokenizer))
    phis = {}
    for replica, shift in ((0, 0.01), (1, 0.02)):
        for s in range(2):
            phis[(s, replica)] = _replica_checkpoint(
                config, llama, ranges, s, tmp_path / f"ckpt{s}{replica}", manifest_hash, shift
            )

    out = tmp_path / "model"
    result = cli(
        overrides, "export", "--from-checkpoint", str(tmp_path / "ckpt00"), str(tmp_path / "ckpt10"), "--out", str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)

    # The stages chained, with phi of replica 0 loaded, give the same logits as the exported model.
    stages = [build_run_stage(config, llama, ranges, s) for s in range(2)]
    with torch.no_grad():
        for s, stage in enumerate(stages):
            for name, param in stage.named_parameters():
                param.copy_(phis[(s, 0)][name])
        tokens = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(1))
        chained = stages[1](stages[0](tokens))
        exported = model(input_ids=tokens).logits
    assert torch.allclose(exported, chained, rtol=1e-5, atol=1e-6), (exported - chained).abs().max()

    # --average: the mean of both replicas' phi, for every parameter.
    averaged_dir = tmp_path / "averaged"
    result = cli(
        overrides,
        "export",
        "--from-checkpoint",
        *(str(tmp_path / f"ckpt{s}{r}") for s in range(2) for r in range(2)),
        "--out",
        str(averaged_dir),
        "--average",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    averaged = AutoModelForCausalLM.from_pretrained(averaged_dir, local_files_only=True, dtype=torch.float32)
    state = averaged.state_dict()
    for (s, _), phi in list(phis.items())[:2]:
        for name in phi:
            mean = (phis[(s, 0)][name].double() + phis[(s, 1)][name].double()) / 2
            assert torch.allclose(state[name].double(), mean, rtol=0, atol=1e-7), name

    # The same CLI in this process (the console script is tested above; this saves the imports).
    sets = [a for o in overrides for a in ("--set", o)]
    # A checkpoint of another run is refused, naming what to pass.
    assert (
        main(
            [
                "export",
                "--from-checkpoint",
                str(tmp_path / "ckpt00"),
                str(tmp_path / "ckpt10"),
                "--out",
                str(tmp_path / "wrong"),
                *sets,
                "--set",
                "run.seed=5",
            ]
        )
        == 1
    )
    assert "another run or model" in capsys.readouterr().err

    assert main(["eval", str(out), "--sequences", "8", *sets, "--set", "data.holdout_fraction=0"]) == 2
    assert "data.holdout_fraction" in capsys.readouterr().err
    assert main(["eval", str(out), "--json", "--sequences", "8", *sets]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sequences"] >= 1 and report["perplexity"] == pytest.approx(2.718281828 ** report["loss"], rel=1e-6)
    assert main(["generate", str(out), "--prompt", "In the beginning", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("In the beginning") and len(text.strip()) > len("In the beginning")


def _read(node) -> dict:
    return json.loads(node.ready_file.read_text())


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_live_export_from_a_2x2_swarm(tmp_path, make_swarm):
    """A live 2-stage x 2-replica NoLoCo swarm after 6 steps: `export --initial-peers` loads in plain
    transformers with the logits of the replicas' stages chained; `--average` is the mean of every
    replica's phi; the nodes' checkpoints (written as they stop) export to the same model."""
    from transformers import AutoModelForCausalLM

    from noloco_node.node.export import fetch_replicas

    overrides = tiny_overrides(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "outer.method": "noloco",
            "data.holdout_fraction": 0.05,
            "outer.inner_steps_per_outer": 2,
            "timeouts.match_s": 3.0,
        },
    )
    config, _, tokenizer = prepare_tokenizer(overrides)
    _, _, manifest_hash = load_run_inputs(config)
    swarm = make_swarm(overrides)
    ck = {(s, r): tmp_path / f"ck{s}{r}" for s in range(2) for r in range(2)}
    stage1 = [swarm.start_node(1, r, "--set", f"checkpoint.dir={ck[(1, r)]}") for r in range(2)]
    swarm.wait_ready(stage1)
    stage0 = [
        swarm.start_node(
            0, r, "--steps", "6", "--serve-after", "--wait-replicas", "2", "--set", f"checkpoint.dir={ck[(0, r)]}"
        )
        for r in range(2)
    ]
    swarm.wait_ready(stage0)
    _wait_until(
        lambda: all(_read(n)["inner_step"] >= 6 and _read(n)["outer_round"] >= 3 for n in stage0),
        240,
        "stage 0 to finish 6 steps and 3 outer rounds",
    )
    # Quiet: stage 1 has stepped on everything it received and its last rounds are over.
    last = None
    while True:
        now = [(_read(n)["inner_step"], _read(n)["outer_round"], _read(n)["status"]) for n in stage0 + stage1]
        if now == last and all(status != "matching" for _, _, status in now):
            break
        last = now
        time.sleep(config.timeouts.match_s + 1)

    sets = [a for o in overrides for a in ("--set", o)]
    live, averaged = tmp_path / "live", tmp_path / "live-avg"
    for out, extra in ((live, []), (averaged, ["--average"])):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "noloco_node",
                "export",
                "--initial-peers",
                swarm.maddr,
                "--out",
                str(out),
                *extra,
                *sets,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        print(result.stdout.strip())

    llama, ranges = run_model(config, len(tokenizer))
    found = asyncio.run(
        fetch_replicas(
            load_config(overrides=overrides + [f"network.initial_peers={swarm.maddr}"]),
            manifest_hash,
            llama,
            ranges,
            every_replica=True,
            timeout_s=60,
        )
    )
    assert sorted(len(v) for v in found.values()) == [2, 2], {s: [p for p, _, _ in v] for s, v in found.items()}

    exported = AutoModelForCausalLM.from_pretrained(live, local_files_only=True, dtype=torch.float32)
    state = exported.state_dict()
    chosen = []
    for s in range(2):  # the plain export took one live replica's phi, whole
        match = [phi for _, phi, _ in found[s] if all(torch.equal(state[n], t) for n, t in phi.items())]
        assert match, f"stage {s}: the export is no replica's phi"
        chosen.append(match[0])
    stages = [build_run_stage(config, llama, ranges, s) for s in range(2)]
    with torch.no_grad():
        for stage, phi in zip(stages, chosen):
            for name, param in stage.named_parameters():
                param.copy_(phi[name])
        tokens = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(3))
        assert torch.allclose(exported(input_ids=tokens).logits, stages[1](stages[0](tokens)), rtol=1e-5, atol=1e-6)
    trained = [phi for s in range(2) for _, phi, _ in found[s]]
    initial = [build_run_stage(config, llama, ranges, s) for s in range(2)]
    assert any(
        not torch.equal(phi[n], p) for phi, st in zip(trained[::2], initial) for n, p in st.named_parameters()
    ), "phi never moved: the swarm did not train"

    avg_state = AutoModelForCausalLM.from_pretrained(averaged, local_files_only=True, dtype=torch.float32).state_dict()
    for s in range(2):
        (_, a, _), (_, b, _) = found[s]
        for name in a:
            mean = ((a[name].double() + b[name].double()) / 2).float()
            assert torch.allclose(avg_state[name], mean, rtol=0, atol=1e-7), name

    # The live swarm evaluated as the reference does: column d = replica d (by peer id) of each stage.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "noloco_node",
            "eval",
            "--initial-peers",
            swarm.maddr,
            "--json",
            "--sequences",
            "8",
            *sets,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    from noloco_node.experiments.evaluate import column_losses, held_out_windows, weight_spread

    inputs, labels, _ = held_out_windows(config, 8)
    columns = [[sorted(found[s], key=lambda e: e[0])[d][1] for s in range(2)] for d in range(2)]
    expected = column_losses([st.eval() for st in stages], columns, inputs, labels)
    assert report["columns"] == 2 and report["column_losses"] == pytest.approx(expected, rel=1e-5)
    assert report["loss"] == pytest.approx(sum(expected) / 2, rel=1e-5)
    # Two replicas that paired with each other in the last round hold the same phi: spread 0 is right then.
    assert report["spread"] == pytest.approx(weight_spread(columns), rel=1e-6, abs=1e-12)

    swarm.stop()  # SIGTERM: every node writes its checkpoint as it leaves
    from_ck = tmp_path / "from-ck"
    result = cli(overrides, "export", "--from-checkpoint", *map(str, ck.values()), "--out", str(from_ck), "--average")
    assert result.returncode == 0, result.stderr[-3000:]
    ck_state = AutoModelForCausalLM.from_pretrained(from_ck, local_files_only=True, dtype=torch.float32).state_dict()
    for name, tensor in avg_state.items():
        assert torch.equal(ck_state[name], tensor), name
