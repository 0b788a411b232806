"""The last stage's loss without its logits: the LM head and the cross-entropy, a chunk of tokens
at a time.

Computed whole, the head makes [tokens, vocab] logits, the loss widens them to fp32, and its
backward holds four fp32 tensors of that size at once (model/memory.py: 16 bytes per token and
vocabulary entry at the peak, 8.6 GB for 4 x 1024 tokens of a 128k vocabulary), far more than a
decoder layer's activations. Here the head and the loss run over chunks of tokens; the gradients
with respect to the hidden states and the head's weight are computed in the same pass (the loss
is the graph's last node, so its upstream gradient is a scalar, applied in backward), as Liger
Kernel's fused linear cross-entropy does. What lives at once is one chunk's logits, the hidden
states' gradient and the weight's (fp32). The values are those of `F.cross_entropy` on the whole
logits, to float rounding; under autocast the chunk's matmuls run in bf16 as the head's would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from noloco_node.model.loss_chunks import chunk_tokens

IGNORE = -100
"""Labels equal to this count for nothing, as `F.cross_entropy`'s default ignore_index."""


def head_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk: int | None = None) -> Tensor:
    """Token-mean cross-entropy of `hidden @ weight.T` against `labels` (already the next tokens):
    `F.cross_entropy(F.linear(hidden, weight).float(), labels)` without [tokens, vocab] logits."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = chunk or chunk_tokens(weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadCrossEntropy.apply(hidden, weight, labels, chunk)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        logits = F.linear(hidden[start : start + chunk], weight).float()
        total = total + F.cross_entropy(logits, labels[start : start + chunk], reduction="sum")
    return total / (labels != IGNORE).sum().clamp(min=1)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
        counted = (labels != IGNORE).sum().clamp(min=1)
        # The dtype the head's matmul runs in: autocast's (bf16) where it is on, as the head's
        # own would; the weight cast to it once here, not once per chunk.
        device = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device)
            if torch.is_autocast_enabled(device)
            else torch.promote_types(hidden.dtype, weight.dtype)
        )
        head = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            rows, targets = hidden[start : start + chunk].to(dtype), labels[start : start + chunk]
            log_probs = torch.log_softmax((rows @ head.t()).float(), dim=-1)
            keep, columns = targets != IGNORE, targets.clamp(min=0)[:, None]
            total = total - (log_probs.gather(1, columns).squeeze(1) * keep).sum()
            # d(loss sum)/d(logits) = softmax - one_hot, zero on ignored rows; then / counted.
            grad_logits = log_probs.exp_()
            grad_logits.scatter_add_(1, columns, -keep[:, None].to(grad_logits.dtype))
            grad_logits = grad_logits.mul_(keep[:, None] / counted).to(dtype)
            grad_hidden[start : start + chunk] = (grad_logits @ head).to(hidden.dtype)
            grad_weight += (grad_logits.t() @ rows).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / counted

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None
