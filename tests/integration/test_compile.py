"""pipeline.compile: each decoder layer compiled in place (inductor; on CPU through the machine's C++
compiler). The worker's three kinds of call, a forward without a graph, the recompute through a
weight stash (functional_call) and the backward, give what the eager stage gives."""

import pytest
import torch

from noloco_node.config import load_config
from noloco_node.model.build import build_run_stage, run_model

from ..unit.pipeline.tiny_workers import HIDDEN, SEQ, tiny_worker

# An integration with the machine's C++ toolchain (inductor compiles on CPU): 15-70 s, so not in the fast tier.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_the_config_compiles_every_decoder_layer_in_place():
    cfg = load_config(overrides=["pipeline.num_stages=2", "pipeline.compile=true"])
    config, ranges = run_model(cfg, 4096)
    stage = build_run_stage(cfg, config, ranges, 1)
    layers = list(stage.model.layers.values())
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    eager = build_run_stage(load_config(overrides=["pipeline.num_stages=2"]), config, ranges, 1)
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in eager.named_parameters()]


def test_a_compiled_stage_computes_what_the_eager_stage_computes():
    inputs = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(6))
    results = []
    for compiled in (False, True):
        worker = tiny_worker(1, 3, batch_size=2, auto_step=False, stash_weights=True)
        if compiled:
            worker.stage.compile_layers()
        output = worker.forward("mb", inputs)
        grad_input = worker.backward("mb", grad)
        worker._take_stash_gradients()  # the stash's gradients onto the parameters, as before a step
        results.append((output, grad_input, {n: p.grad.clone() for n, p in worker.stage.named_parameters()}))
    (out_e, gin_e, grads_e), (out_c, gin_c, grads_c) = results
    assert torch.allclose(out_c, out_e, atol=1e-5) and torch.allclose(gin_c, gin_e, atol=1e-5)
    assert grads_e.keys() == grads_c.keys()
    assert all(torch.allclose(grads_c[n], grads_e[n], atol=1e-5) for n in grads_e)
