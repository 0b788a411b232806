"""On a GPU a stage passes no attention mask to SDPA (it is causal by itself and may use its flash
kernels): the stage must still be causal and compute what the masked CPU stage computes. Skipped
where torch sees no CUDA device."""

import pytest
import torch

from noloco_node.model.stage import LlamaStage, build_stage, llama_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEED = 77


def stage_on(device: str) -> LlamaStage:
    config = llama_config(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        max_seq_len=64,
        attn_implementation="sdpa",
    )
    return build_stage(config, seed=SEED, stage_index=0, num_stages=1, device=device)


def tokens() -> torch.Tensor:
    return torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(3))


def test_cuda_stage_equals_the_masked_cpu_stage_in_float32():
    x = tokens()
    cpu = stage_on("cpu")(x)
    assert cpu.is_cpu and stage_on("cpu")._mask(torch.zeros(1, 64, 128)) is not None  # the CPU keeps its mask
    gpu = stage_on("cuda")(x.cuda()).cpu()
    assert torch.linalg.norm(gpu - cpu) / torch.linalg.norm(cpu) < 1e-4


@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_stage_is_causal(autocast):
    stage = stage_on("cuda")
    x = tokens().cuda()
    changed = x.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 97  # only positions 40.. differ
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        a, b = stage(x), stage(changed)
    assert (a[:, :40] - b[:, :40]).abs().max() < 1e-5  # nothing leaks back from a later token
    assert (a[:, 40:] - b[:, 40:]).abs().max() > 1e-3
