"""The residual-subspace model (model/subspace.py): U orthonormal and the same everywhere, the
split model equal to the whole one in float64, exact reconstruction at a boundary, and a dense
Hugging Face export that computes what the subspace model computes."""

import pytest
import torch

from noloco_node.model.stage import LlamaStage, build_full_model, build_stage, llama_config
from noloco_node.model.split import FREE_FINAL_LAYERS
from noloco_node.model.subspace import ResidualSubspace, SubspaceLinear, residual_basis

SEED, RANK = 1234, 8


def tiny_config(layers=6, hidden=32):
    return llama_config(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        max_seq_len=64,
        attn_implementation="eager",
    )


def batch(vocab=97, batch_size=2, seq_len=16):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_basis_is_orthonormal_and_the_same_for_every_build():
    u = residual_basis(SEED, 64, 16)
    assert u.shape == (64, 16) and u.dtype == torch.float64
    torch.testing.assert_close(u.T @ u, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-14)
    assert torch.equal(u, residual_basis(SEED, 64, 16))
    assert not torch.allclose(u, residual_basis(SEED + 1, 64, 16))
    config = tiny_config()
    stages = [build_stage(config, seed=SEED, stage_index=s, num_stages=3, subspace_rank=RANK) for s in range(3)]
    full = build_full_model(config, SEED, subspace_rank=RANK)
    for stage in stages:  # every node, under every split, holds the same U and fixed table
        assert torch.equal(stage.subspace.basis, full.subspace.basis)
        assert torch.equal(stage.subspace.fixed, full.subspace.fixed)
    with pytest.raises(ValueError, match="rank"):
        residual_basis(SEED, 32, 33)


def test_only_the_writes_into_the_stream_are_constrained_and_nothing_of_the_subspace_is_a_parameter():
    config = tiny_config()
    full = build_full_model(config, SEED, subspace_rank=RANK)
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (97, RANK)
    last = config.num_hidden_layers - FREE_FINAL_LAYERS
    for i in range(config.num_hidden_layers):
        constrained = i < last
        assert shapes[f"model.layers.{i}.self_attn.o_proj.weight"] == ((RANK, 32) if constrained else (32, 32))
        assert shapes[f"model.layers.{i}.mlp.down_proj.weight"] == ((RANK, 64) if constrained else (32, 64))
        assert shapes[f"model.layers.{i}.self_attn.q_proj.weight"] == (32, 32)
    assert shapes["lm_head.weight"] == (97, 32)
    assert not any("basis" in n or "fixed" in n for n in shapes)
    assert not any("basis" in n or "fixed" in n for n in full.state_dict())  # derived from the seed, never saved
    dense = build_full_model(config, SEED)
    assert sum(p.numel() for p in full.parameters()) < sum(p.numel() for p in dense.parameters())


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_split_subspace_model_equals_the_whole_one_in_float64(num_stages):
    config = tiny_config()
    inputs, labels = batch()
    full = build_full_model(config, SEED, subspace_rank=RANK).double()
    loss_full = LlamaStage.loss(full(input_ids=inputs).logits, labels)
    loss_full.backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}

    stages = [
        build_stage(config, seed=SEED, stage_index=s, num_stages=num_stages, subspace_rank=RANK).double()
        for s in range(num_stages)
    ]
    boundary, x = [], inputs
    for stage in stages:  # as the pipeline runs it: coordinates cross, with the token ids
        if not stage.is_first:
            assert x.shape == (*inputs.shape, RANK)
            x = x.detach().requires_grad_()
        boundary.append(x)
        x = stage(x, inputs)
    torch.testing.assert_close(LlamaStage.loss(x, labels), loss_full, rtol=1e-12, atol=0)
    grad = None
    for stage, stage_input in zip(reversed(stages), reversed(boundary)):
        output = stage(stage_input, inputs)
        if stage.is_last:
            LlamaStage.loss(output, labels).backward()
        else:
            output.backward(grad)
        grad = None if stage.is_first else stage_input.grad
        assert grad is None or grad.shape == (*inputs.shape, RANK)  # U^T g: k per token back
    seen = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, full_grads[name], rtol=1e-9, atol=1e-12, msg=name)
            seen.add(name)
    assert seen == set(full_grads)


def test_coordinates_rebuild_the_stream_exactly_in_float32():
    config = tiny_config(hidden=64)
    stage = build_stage(config, seed=SEED, stage_index=0, num_stages=2, subspace_rank=16)
    inputs, _ = batch()
    with torch.no_grad():
        hidden = stage.model.embed_tokens(inputs)
        for layer in stage.model.layers.values():
            hidden = layer(
                hidden,
                attention_mask=stage._mask(hidden),
                position_ids=torch.arange(16)[None],
                position_embeddings=stage.rotary_emb(hidden, torch.arange(16)[None]),
            )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        coordinates = stage(inputs)
        rebuilt = stage.subspace.from_coordinates(coordinates, inputs)
    assert coordinates.dtype == torch.float32 and coordinates.shape == (2, 16, 16)
    torch.testing.assert_close(rebuilt, hidden, rtol=0, atol=1e-5 * float(hidden.abs().max()))


def test_the_dense_export_computes_what_the_subspace_model_computes():
    config = tiny_config()
    inputs, _ = batch()
    model = build_full_model(config, SEED, subspace_rank=RANK).double()
    with torch.no_grad():
        for p in model.parameters():  # trained weights, not phi_0
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    dense = build_full_model(config, SEED).double()
    weights = {
        n: model.subspace.dense(n, p.detach()) if p.shape != dict(dense.named_parameters())[n].shape else p.detach()
        for n, p in model.named_parameters()
    }
    dense.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(
            dense(input_ids=inputs).logits, model(input_ids=inputs).logits, rtol=1e-10, atol=1e-10
        )


def test_a_subspace_linear_writes_only_inside_the_span():
    subspace = ResidualSubspace(seed=SEED, vocab_size=11, hidden_size=32, rank=4, initializer_range=0.02)
    layer = SubspaceLinear(20, subspace)
    torch.nn.init.normal_(layer.weight)
    out = layer(torch.randn(3, 20)).double()
    u = subspace.basis
    torch.testing.assert_close(out - out @ u @ u.T, torch.zeros_like(out), rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_the_memory_estimate_counts_the_subspace_parameters(num_stages):
    from noloco_node.model.memory import stage_params
    from noloco_node.model.split import stage_layer_ranges

    config = tiny_config()
    for s, layers in enumerate(stage_layer_ranges(config.num_hidden_layers, num_stages)):
        stage = build_stage(config, seed=SEED, stage_index=s, num_stages=num_stages, subspace_rank=RANK)
        built = sum(p.numel() for p in stage.parameters())
        assert built == stage_params(config, layers, first=s == 0, last=s == num_stages - 1, subspace=RANK)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_lossy_hop_moves_the_rebuilt_stream_only_by_the_codec_s_error(codec):
    """U is an isometry: the rebuilt stream is off by exactly the coordinates' codec error (in norm),
    and that error is within the blockwise codec's bound (half a step of each block's absmax)."""
    from noloco_node.pipeline.memory import through_wire

    config = tiny_config(hidden=64)
    stage = build_stage(config, seed=SEED, stage_index=0, num_stages=2, subspace_rank=16)
    inputs, _ = batch()
    with torch.no_grad():
        coordinates = stage(inputs)
        _, received, _ = through_wire(coordinates, codec)
        exact = stage.subspace.from_coordinates(coordinates.double(), inputs)
        rebuilt = stage.subspace.from_coordinates(received.double(), inputs)
    error = (received.double() - coordinates.double()).reshape(-1)
    torch.testing.assert_close((rebuilt - exact).norm(), error.norm(), rtol=1e-9, atol=1e-12)
    levels = 127 if codec == "int8" else 7
    blocks = coordinates.double().reshape(-1, 64)
    bound = (blocks.abs().amax(dim=1, keepdim=True) / levels / 2).expand_as(blocks).reshape(-1)
    assert bool((error.abs() <= bound * (1 + 1e-6) + 1e-12).all())
