"""A bf16 hop reaches the worker as bfloat16 (codec/checked.py's decode_received): the stage widens
it to float32 on its device and computes exactly what the float32 tensor would give."""

import pytest
import torch

from .tiny_workers import HIDDEN, SEQ, tiny_worker


def received(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bfloat16 tensor a receiver hands on, the float32 tensor it stands for)."""
    narrow = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return narrow, narrow.float()


def test_a_middle_stage_computes_the_same_forward_and_backward_from_bf16_inputs():
    narrow, wide = received(1)
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = []
    for inputs in (narrow, wide):
        worker = tiny_worker(1, 3, batch_size=2, auto_step=False)
        output = worker.forward("mb", inputs)
        grad_input = worker.backward("mb", grad)
        results.append((output, grad_input, [p.grad.clone() for p in worker.stage.parameters()]))
    (out_a, gin_a, grads_a), (out_b, gin_b, grads_b) = results
    assert out_a.dtype == torch.float32 and gin_a.dtype == torch.float32
    assert torch.equal(out_a, out_b) and torch.equal(gin_a, gin_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_last_stage_computes_the_same_loss_and_input_gradient_from_bf16_inputs():
    narrow, wide = received(3)
    labels = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(4))
    workers = [tiny_worker(1, 2, batch_size=2, auto_step=False) for _ in range(2)]
    results = [worker.forward_backward_last(x, labels) for worker, x in zip(workers, (narrow, wide))]
    (grad_a, loss_a, tokens_a), (grad_b, loss_b, tokens_b) = results
    assert grad_a.dtype == torch.float32 and torch.equal(grad_a, grad_b)
    assert loss_a == loss_b and tokens_a == tokens_b == 2 * SEQ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_bf16_hop_is_pinned_copied_and_widened_there():
    from noloco_node.model.stage import build_stage, llama_config
    from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
    from noloco_node.pipeline.worker import StageWorker, WorkerSettings

    config = llama_config(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=32, num_layers=2, num_heads=2, max_seq_len=SEQ
    )
    narrow, wide = received(7)
    outputs = []
    for inputs in (narrow, wide):
        stage = build_stage(config, seed=0, stage_index=1, num_stages=2, device="cuda")
        inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
        worker = StageWorker(stage, inner, WorkerSettings(batch_size=2, saved_ttl_s=60, auto_step=False, device="cuda"))
        outputs.append(worker.forward_backward_last(inputs, torch.zeros(2, SEQ, dtype=torch.int64)))
    (grad_a, loss_a, _), (grad_b, loss_b, _) = outputs
    assert grad_a.device.type == "cpu" and torch.equal(grad_a, grad_b) and loss_a == loss_b
