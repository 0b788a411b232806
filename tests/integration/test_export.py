"""The trained model out: node checkpoints of every stage become a standard Hugging Face model
directory (`noloco-node export --from-checkpoint`) that plain `transformers` loads offline, whose
logits equal the stages chained, with `--average` the mean of the replicas' phi; `eval` and
`generate` run on it."""

import json
import subprocess
import sys

import pytest
import torch

from noloco_node import checkpoint
from noloco_node.cli.main import main
from noloco_node.manifest import load_run_inputs
from noloco_node.model.build import build_run_stage, run_model
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def cli(overrides, *args, timeout=180):
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "noloco_node", args[0], *args[1:], *sets], capture_output=True,
                          text=True, timeout=timeout)


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
    checkpoint.save(directory, stage_index, tensors, counters, {"run_id": config.run.run_id,
                                                                "manifest_hash": manifest_hash, "peer_id": f"r{shift}"})
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
            phis[(s, replica)] = _replica_checkpoint(config, llama, ranges, s, tmp_path / f"ckpt{s}{replica}",
                                                     manifest_hash, shift)

    out = tmp_path / "model"
    result = cli(overrides, "export", "--from-checkpoint", str(tmp_path / "ckpt00"), str(tmp_path / "ckpt10"),
                 "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float32)

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
    result = cli(overrides, "export", "--from-checkpoint", *(str(tmp_path / f"ckpt{s}{r}") for s in range(2) for r in range(2)),
                 "--out", str(averaged_dir), "--average")
    assert result.returncode == 0, result.stderr[-3000:]
    averaged = AutoModelForCausalLM.from_pretrained(averaged_dir, local_files_only=True, torch_dtype=torch.float32)
    state = averaged.state_dict()
    for (s, _), phi in list(phis.items())[:2]:
        for name in phi:
            mean = (phis[(s, 0)][name].double() + phis[(s, 1)][name].double()) / 2
            assert torch.allclose(state[name].double(), mean, rtol=0, atol=1e-7), name

    # The same CLI in this process (the console script is tested above; this saves the imports).
    sets = [a for o in overrides for a in ("--set", o)]
    # A checkpoint of another run is refused, naming what to pass.
    assert main(["export", "--from-checkpoint", str(tmp_path / "ckpt00"), str(tmp_path / "ckpt10"), "--out",
                 str(tmp_path / "wrong"), *sets, "--set", "run.seed=5"]) == 1
    assert "another run or model" in capsys.readouterr().err

    assert main(["eval", str(out), "--json", "--sequences", "8", *sets]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sequences"] >= 1 and report["perplexity"] == pytest.approx(2.718281828 ** report["loss"], rel=1e-6)
    assert main(["generate", str(out), "--prompt", "In the beginning", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("In the beginning") and len(text.strip()) > len("In the beginning")
