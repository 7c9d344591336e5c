"""Vocabulary parallelism of the embedding and the loss (Megatron): the embedding table's rows and the
output layer's logits are split over t by vocabulary range, rank r holding ids [r·V/t, (r+1)·V/t)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pipewright.errors import ConfigError
from pipewright.models.cross_entropy import fp32_logits, softmax_grad_
from pipewright.runtime.parallel.tp.ops import (
    Group,
    all_gather,
    all_reduce,
    count_once,
    divide,
    reduce_from,
    reduce_scatter_to_seq,
    tp_rank,
    tp_size,
)
from pipewright.runtime.parallel.tp.parallel_linears import shard


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over t by vocabulary range: rank r holds ids
    [r·V/t, (r+1)·V/t). Ids outside the range look up row 0 and are masked to zero, then the partial
    embeddings (and the tensor to add, once) are all-reduced (with ``sequence_parallel``,
    reduce-scattered along the sequence).
    Initialised like ``nn.Embedding`` (N(0, 1)) on the full [V, h] table; this rank keeps its rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Group,
        *,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        generator: torch.Generator | None = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.tp, self.rank = tp_size(group), tp_rank(group)
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.per_rank = divide(num_embeddings, self.tp, "the vocabulary size (pad it to a multiple of t)")
        self.vocab_start = self.rank * self.per_rank
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
        nn.init.normal_(full, generator=generator)
        self.weight = nn.Parameter(shard(full, 0, self.rank, self.tp))

    @torch.no_grad()
    def load_full_(self, weight: Tensor) -> None:
        """Copy in this rank's rows of a full-size [V, h] table."""
        self.weight.copy_(shard(weight, 0, self.rank, self.tp))

    @torch.no_grad()
    def full_weight(self, grad: bool = False) -> Tensor:
        """The full [V, h] table (or its gradient) gathered from the group (collective call)."""
        return all_gather(self.weight.grad if grad else self.weight, 0, self.group)

    def forward(self, ids: Tensor, add: Tensor | None = None) -> Tensor:
        """Embeddings of ``ids`` [b, s] (+ ``add``, a replicated tensor broadcastable to [b, s, h]: the
        position embeddings), reduced over the group: [b, s, h], or this rank's [b, s/t, h] chunk with
        sequence parallelism. ``add`` joins the partial sums before the reduction, once
        (:func:`count_once`), so its gradient is the whole output gradient on every rank: equal over tp
        and whole, as Megatron-LM's position embedding's is (added before the scatter to the
        sequence-parallel region) — no gradient all-reduce over tp."""
        if self.tp > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if add is not None:
            out = out + count_once(add, self.group)
        if self.sequence_parallel:
            return reduce_scatter_to_seq(out, self.group, self.seq_dim)
        return reduce_from(out, self.group)

    def extra_repr(self) -> str:
        return f"V={self.num_embeddings}, h={self.embedding_dim}, t={self.tp}, rows from {self.vocab_start}"


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (Megatron): three all-reduces —
    global max (stability), target logit, Σ exp. loss = log Σ_v exp(z_v − m) − (z_target − m).
    Backward on the shard: (softmax − one_hot(target)) · grad, written into the kept fp32 softmax
    (:mod:`pipewright.models.cross_entropy`: 4 bytes a logit kept, none of the 16-bit logits)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: Group) -> Tensor:
        z = fp32_logits(logits)  # turned into the softmax in place, kept, and the gradient's buffer
        v_local = z.size(-1)
        z_max = all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
        z.sub_(z_max.unsqueeze(-1))
        start = tp_rank(group) * v_local
        outside = (targets < start) | (targets >= start + v_local)
        local_t = (targets - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = all_reduce(target_logit, group)
        sum_exp = all_reduce(z.exp_().sum(-1), group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(z.div_(sum_exp.unsqueeze(-1)), outside, local_t)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        softmax, outside, local_t = ctx.saved_tensors
        return softmax_grad_(softmax, local_t, ~outside, g, ctx.in_dtype), None, None


def sharded_vocab_cross_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    group: Group,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Cross-entropy of logits whose last dimension is this rank's 1/t of the vocabulary (rank r:
    [r·V/t, (r+1)·V/t)). ``targets`` are global ids, shaped like ``logits_shard[..., 0]``. Same
    semantics as ``F.cross_entropy``: targets equal to ``ignore_index`` contribute nothing;
    ``reduction`` is "mean" (over the other targets), "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"reduction must be mean, sum or none, not {reduction!r}")
    loss = _VocabParallelCE.apply(logits_shard, targets, group)
    valid = targets != ignore_index
    loss = loss * valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)
