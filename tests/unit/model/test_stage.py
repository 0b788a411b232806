"""Stages chained equal the whole LlamaForCausalLM: logits, loss and every parameter gradient."""

import pytest
import torch

from noloco_node.model.split import stage_layer_ranges
from noloco_node.model.stage import LlamaStage, build_full_model, build_stage, llama_config

SEED = 1234


def tiny_config(attn="sdpa", layers=6):
    return llama_config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        max_seq_len=64,
        attn_implementation=attn,
    )


def batch(vocab=97, batch_size=2, seq_len=16):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_layer_ranges():
    assert [list(r) for r in stage_layer_ranges(6, 3)] == [[0, 1], [2, 3], [4, 5]]
    assert [len(r) for r in stage_layer_ranges(7, 3)] == [2, 3, 2]
    assert [len(r) for r in stage_layer_ranges(5, 1)] == [5]
    with pytest.raises(ValueError, match="every stage needs"):
        stage_layer_ranges(2, 3)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_chained_stages_equal_full_model(num_stages, attn):
    config = tiny_config(attn)
    inputs, labels = batch()
    full = build_full_model(config, SEED)
    logits_full = full(input_ids=inputs).logits
    loss_full = LlamaStage.loss(logits_full, labels)
    loss_full.backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}

    stages = [build_stage(config, seed=SEED, stage_index=s, num_stages=num_stages) for s in range(num_stages)]
    whole = dict(full.named_parameters())
    for stage in stages:  # phi_0 (model/init.py): the whole model is its stages, bit for bit
        for name, param in stage.named_parameters():
            assert torch.equal(param, whole[name]), name
    # Run as the pipeline does: each boundary is a detached leaf, gradients are handed back by hand.
    boundary_inputs, x = [], inputs
    for stage in stages:
        if not stage.is_first:
            x = x.detach().requires_grad_()
        boundary_inputs.append(x)
        x = stage(x)
    loss = LlamaStage.loss(x, labels)
    torch.testing.assert_close(x, logits_full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, loss_full, rtol=1e-5, atol=0)
    grad = None
    for stage, stage_input in zip(reversed(stages), reversed(boundary_inputs)):
        output = stage(stage_input)
        if stage.is_last:
            LlamaStage.loss(output, labels).backward()
        else:
            output.backward(grad)
        grad = stage_input.grad if not stage.is_first else None

    seen = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, full_grads[name], rtol=1e-5, atol=1e-7, msg=name)
            seen.add(name)
    assert seen == set(full_grads), "stages must cover exactly the full model's parameters"


def test_replicas_from_same_seed_are_identical_and_global_rng_untouched():
    config = tiny_config()
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    a = build_stage(config, seed=SEED, stage_index=1, num_stages=2)
    b = build_stage(config, seed=SEED, stage_index=1, num_stages=2)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    other = build_stage(config, seed=SEED + 1, stage_index=1, num_stages=2)
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)
    # Llama's init (std 0.02), not PyTorch's default Linear init.
    assert a.model.layers["3"].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_stage_is_causal(attn):
    stage = build_stage(tiny_config(attn), seed=SEED, stage_index=0, num_stages=1)
    inputs, _ = batch(seq_len=12)
    changed = inputs.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 97
    with torch.no_grad():
        out, out_changed = stage(inputs), stage(changed)
    torch.testing.assert_close(out[:, :8], out_changed[:, :8])
    assert not torch.allclose(out[:, 8:], out_changed[:, 8:])


def test_tied_embeddings_rejected():
    config = tiny_config()
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        build_stage(config, seed=SEED, stage_index=0, num_stages=2)
