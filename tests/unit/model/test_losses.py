"""The last stage's loss a chunk of tokens at a time (model/losses.py): the values and gradients of
the whole-logits cross-entropy, without ever making the [tokens, vocab] logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from noloco_node.model.loss_chunks import chunk_tokens
from noloco_node.model.losses import IGNORE, head_cross_entropy
from noloco_node.model.stage import build_stage, llama_config

TOKENS, HIDDEN, VOCAB = 24, 16, 40


def inputs(seed: int = 0, ignored: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(VOCAB, HIDDEN, generator=g)).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    labels.view(-1)[:ignored] = IGNORE
    return hidden, weight, labels


def whole(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def value_and_grads(loss_fn, hidden, weight, labels, scale=1.0):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(hidden, weight, labels)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 7, TOKENS, 1000])
@pytest.mark.parametrize("ignored", [0, 5])
def test_chunked_equals_the_whole_logits_loss_and_gradients(chunk, ignored):
    hidden, weight, labels = inputs(1, ignored)
    expected = value_and_grads(whole, hidden, weight, labels, scale=0.25)  # the worker's b/B scale
    actual = value_and_grads(
        lambda h, w, y: head_cross_entropy(h, w, y, chunk=chunk), hidden, weight, labels, scale=0.25
    )
    for a, e, what in zip(actual, expected, ("loss", "hidden gradient", "weight gradient")):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=what)


def test_without_gradients_it_is_the_same_value():
    hidden, weight, labels = inputs(2, ignored=3)
    with torch.no_grad():
        torch.testing.assert_close(head_cross_entropy(hidden, weight, labels, chunk=5), whole(hidden, weight, labels))


def test_under_bf16_autocast_it_matches_the_heads_own_bf16_path():
    hidden, weight, labels = inputs(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = value_and_grads(whole, hidden, weight, labels)
        actual = value_and_grads(lambda h, w, y: head_cross_entropy(h, w, y, chunk=7), hidden, weight, labels)
    assert actual[1].dtype == hidden.dtype and actual[2].dtype == weight.dtype
    for a, e, what in zip(actual, expected, ("loss", "hidden gradient", "weight gradient")):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-3, msg=what)


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output had."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_the_size_of_the_logits_is_ever_made():
    hidden, weight, labels = inputs(4)
    with LargestTensor() as seen:
        value_and_grads(whole, hidden, weight, labels)
    assert seen.largest == TOKENS * VOCAB  # the logits
    with LargestTensor() as seen:
        value_and_grads(lambda h, w, y: head_cross_entropy(h, w, y, chunk=4), hidden, weight, labels)
    assert seen.largest == VOCAB * HIDDEN < TOKENS * VOCAB  # the weight's gradient; a chunk's logits are 4 x 40


def test_chunks_are_sized_by_the_vocabulary():
    assert chunk_tokens(4096) == 8192 and chunk_tokens(128256) == 261 and chunk_tokens(1 << 30) == 1


def test_the_last_stage_returns_its_loss_given_labels():
    config = llama_config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_layers=2, num_heads=2, max_seq_len=8
    )
    stage = build_stage(config, seed=0, stage_index=1, num_stages=2)
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(stage(x, labels=labels), stage.loss(stage(x), labels))
