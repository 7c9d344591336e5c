"""Cross-entropy over the logits the way Megatron-LM's vocabulary-parallel loss keeps memory: one fp32
copy of the logits, turned in place into the softmax and kept for the backward, whose gradient is
written into that same buffer (``VocabParallelCrossEntropy``: ``grad_input = softmax``, the target
column decremented in place). The 16-bit logits are not kept; per logit the forward's peak is the
16-bit logits beside the fp32 copy (2 + 4 bytes), the step keeps 4, and the backward's peak is the
fp32 gradient beside its 16-bit cast (4 + 2). PyTorch's ``F.cross_entropy(logits.float())`` keeps the
fp32 log-softmax and allocates two more fp32 tensors of the logits' size in its backward (12 bytes per
logit at the peak).

loss_i = log Σ_v exp(z_iv − m_i) − (z_i,target − m_i); ∂loss_i/∂z_iv = softmax_iv − [v = target].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fp32_logits(logits: Tensor) -> Tensor:
    """An fp32 copy of ``logits`` this loss may overwrite (a copy also when they are fp32 already)."""
    return logits.to(torch.float32, copy=True)


def softmax_grad_(softmax: Tensor, index: Tensor, hit: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """In place: ``softmax`` (fp32, [..., V]) becomes (softmax − one_hot(index) where ``hit``) · grad,
    returned cast to ``dtype`` (the logits' dtype)."""
    softmax.scatter_add_(-1, index.unsqueeze(-1), -hit.to(softmax.dtype).unsqueeze(-1))
    softmax.mul_(grad.unsqueeze(-1))
    return softmax.to(dtype)


class _SoftmaxCE(torch.autograd.Function):
    """Per-token loss of ``logits`` [..., V] against ``targets`` [...] (0 where ``ignore_index``)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
        z = fp32_logits(logits)
        valid = targets != ignore_index
        index = targets.masked_fill(~valid, 0)
        z.sub_(z.amax(dim=-1, keepdim=True))
        target_logit = z.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        sum_exp = z.exp_().sum(-1)
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(z.div_(sum_exp.unsqueeze(-1)), index, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        softmax, index, valid = ctx.saved_tensors
        return softmax_grad_(softmax, index, valid, g * valid, ctx.in_dtype), None, None


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over the targets not equal to ``ignore_index`` (``F.cross_entropy``'s
    semantics, computed in fp32 whatever the logits' dtype; module docstring)."""
    loss = _SoftmaxCE.apply(logits, targets, ignore_index)
    valid = targets != ignore_index
    return loss.sum() / valid.sum().clamp(min=1)
