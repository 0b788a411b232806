"""A bf16 hop reaches the worker as bfloat16 (codec/checked.py's decode_received): the stage widens
it to float32 on its device and computes exactly what the float32 tensor would give."""

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
