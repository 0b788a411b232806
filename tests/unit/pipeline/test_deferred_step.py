"""A last stage's auto step left due until its gradient has been sent (worker.defer_step) gives
the same weights, step for step, as the step taken at once; and any compute that comes first
takes the due step before it starts."""

import torch

from noloco_node.pipeline.worker import StageWorker

from .tiny_workers import HIDDEN, SEQ, VOCAB, tiny_worker


def last_stage_worker(defer: bool) -> StageWorker:
    return tiny_worker(1, 2, batch_size=4, auto_step=True, defer_step=defer)


def microbatches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, SEQ, HIDDEN, generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)) for _ in range(n)
    ]


def test_a_deferred_step_waits_for_the_caller_and_changes_nothing():
    now, deferred = last_stage_worker(False), last_stage_worker(True)
    data = microbatches(6)  # 3 batches of 2 microbatches (B = 4 sequences)
    for i, (x, y) in enumerate(data):
        grad_now = now.forward_backward_last(x, y)[0]
        grad_deferred = deferred.forward_backward_last(x, y)[0]
        torch.testing.assert_close(grad_deferred, grad_now, rtol=0, atol=0)
        if i % 2 == 1:  # the batch's last gradient: stepped at once in one, due in the other
            assert now.inner_steps == i // 2 + 1 and deferred.inner_steps == i // 2 and deferred.step_due
            if i == 1:
                assert deferred.step_if_due() and not deferred.step_if_due()  # the caller takes it, once
            # after batch 2 the caller is slow: the next batch's first microbatch takes it first
        else:
            assert not deferred.step_due
    assert deferred.step_if_due()  # the last batch's step, left to the caller
    assert now.inner_steps == deferred.inner_steps == 3
    for (name, a), b in zip(now.stage.named_parameters(), deferred.stage.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
