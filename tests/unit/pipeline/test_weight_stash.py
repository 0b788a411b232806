"""Stage 0 under the overlap schedule (worker.stash_weights): an inner step taken between a
microbatch's forward and its backward neither breaks the kept graph nor changes its gradient, which
is the gradient at the weights the forward saw; without the stash the same sequence fails, which is
why the overlap schedule needs it."""

import pytest
import torch

from noloco_node.pipeline.worker import StageWorker

from .tiny_workers import HIDDEN, SEQ, VOCAB, tiny_worker


def first_stage_worker(stash: bool) -> StageWorker:
    return tiny_worker(0, 2, batch_size=2, auto_step=False, stash_weights=stash)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def grad_at(weights: dict[str, torch.Tensor], ids: torch.Tensor, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: a fresh stage-0 worker loaded with `weights`, one forward and backward."""
    reference = first_stage_worker(False)
    with torch.no_grad():
        for name, p in reference.params.items():
            p.copy_(weights[name])
    reference.forward("ref", ids, keep_graph=True)
    reference.backward("ref", grad_output)
    return {n: p.grad.clone() for n, p in reference.params.items() if p.grad is not None}


def accumulate_a_gradient(worker: StageWorker) -> None:
    """So that the next step really moves the weights (Adam skips parameters without a gradient)."""
    worker.forward("warm", tokens(0), keep_graph=True)
    worker.backward("warm", torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(9)))


def test_a_step_between_forward_and_backward_keeps_the_forwards_weights():
    worker = first_stage_worker(True)
    accumulate_a_gradient(worker)
    before = {n: p.detach().clone() for n, p in worker.params.items()}
    ids, grad_output = tokens(1), torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    worker.forward("next", ids, keep_graph=True)  # batch k+1's forward, before step k
    worker.step()  # step k: the parameters change in place
    assert any(not torch.equal(p, before[n]) for n, p in worker.params.items())
    for p in worker.params.values():
        p.grad = None
    worker.backward("next", grad_output)
    worker._take_stash_gradients()  # what step() does first
    expected = grad_at(before, ids, grad_output)
    assert expected
    for name, grad in expected.items():
        torch.testing.assert_close(worker.params[name].grad, grad, rtol=1e-6, atol=1e-7, msg=name)


def test_microbatches_after_a_step_use_a_fresh_copy_and_gradients_accumulate():
    worker = first_stage_worker(True)
    accumulate_a_gradient(worker)
    worker.forward("a", tokens(3), keep_graph=True)
    first_copy = worker.saved["a"].stash
    worker.step()
    worker.forward("b", tokens(4), keep_graph=True)
    assert worker.saved["b"].stash is not first_copy  # the step moved the weights: a new copy
    worker.forward("c", tokens(5), keep_graph=True)
    assert worker.saved["c"].stash is worker.saved["b"].stash  # same version: shared
    for p in worker.params.values():
        p.grad = None
    for key in ("a", "b", "c"):
        worker.backward(key, torch.ones(2, SEQ, HIDDEN))
    embedding = "model.embed_tokens.weight"
    assert worker.params[embedding].grad is None  # held on the copies until the step
    on_copies = first_copy.leaves[embedding].grad.clone() + worker._stash[1].leaves[embedding].grad
    worker._take_stash_gradients()
    assert all(copy.grad is None for copy in first_copy.leaves.values())  # handed to the parameters, once
    torch.testing.assert_close(worker.params[embedding].grad, on_copies, rtol=0, atol=0)


def test_without_the_stash_a_step_between_voids_the_kept_graph():
    worker = first_stage_worker(False)
    accumulate_a_gradient(worker)
    worker.forward("next", tokens(1), keep_graph=True)
    worker.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        worker.backward("next", torch.ones(2, SEQ, HIDDEN))


def test_a_middle_stage_recomputes_on_the_weights_its_forward_saw():
    def middle(stash: bool) -> StageWorker:
        return tiny_worker(1, 3, batch_size=2, auto_step=False, stash_weights=stash)

    gen = torch.Generator().manual_seed(5)
    warm, x, grad_output = (torch.randn(2, SEQ, HIDDEN, generator=gen) for _ in range(3))
    worker, reference = middle(True), middle(False)
    worker.forward("warm", warm)
    worker.backward("warm", grad_output)
    worker.step()  # applies the warm gradient: taken from the copy at the step
    with torch.no_grad():
        for name, p in reference.params.items():
            p.copy_(worker.params[name])
    output = worker.forward("next", x)  # forward at version k
    worker.forward("other", warm)
    worker.backward("other", grad_output)
    worker.step()  # step k, on the other microbatch's gradient, before next's backward
    assert any(not torch.equal(p, reference.params[n]) for n, p in worker.params.items())
    grad_input = worker.backward("next", grad_output)
    worker._take_stash_gradients()
    torch.testing.assert_close(output, reference.forward("ref", x), rtol=0, atol=0)
    expected_input_grad = reference.backward("ref", grad_output)
    torch.testing.assert_close(grad_input, expected_input_grad, rtol=1e-6, atol=1e-7)
    for name, p in reference.params.items():
        torch.testing.assert_close(worker.params[name].grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
