"""Parameters and gradients of a tensor-parallel model: which parameters are shards, the full-size
parameters gathered back, the per-rank share of a global gradient norm and the sequence-parallel
gradient all-reduce of the replicated parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipewright.runtime.parallel.tp.ops import Group, tp_rank, tp_size
from pipewright.runtime.parallel.tp.parallel_linears import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLinear,
)
from pipewright.runtime.parallel.tp.vocab import VocabParallelEmbedding


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` that hold a 1/t shard (column-parallel weights and biases,
    row-parallel weights, vocab-parallel tables); every other parameter is replicated over the
    tensor-parallel group. A global gradient norm sums squares of the shards over the group and counts
    each replicated parameter once."""
    out: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, ColumnParallelLinear):
            out += [p for p in (m.weight, m.bias) if p is not None]
        elif isinstance(m, RowParallelLinear | VocabParallelEmbedding):
            out.append(m.weight)
    return out


@torch.no_grad()
def full_parameters(module: nn.Module, *, grad: bool = False) -> dict[str, Tensor]:
    """Every parameter of ``module`` (or its gradient, None where it has none) by name, the
    tensor-parallel shards gathered to their full size, so that the result equals the ``named_parameters``
    of the same model built without tensor parallelism. Collective over each sharded layer's group
    (call on every tp rank of the group, same module structure); replicated tensors are returned as they
    are (detached, not copied)."""
    out: dict[str, Tensor] = {}
    for prefix, m in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(m, ShardedLinear):
            out[f"{dot}weight"] = m.full_weight(grad=grad)
            if m.bias is not None:
                out[f"{dot}bias"] = m.full_bias(grad=grad)
        elif isinstance(m, VocabParallelEmbedding):
            out[f"{dot}weight"] = m.full_weight(grad=grad)
    for name, p in module.named_parameters():
        if name not in out:
            out[name] = p.grad if grad else p
    return {name: t.detach() if t is not None else None for name, t in out.items()}


def grad_norm_params(module: nn.Module, group: Group) -> list[nn.Parameter]:
    """The parameters whose squared gradients this rank contributes to a global gradient norm: every
    shard, and the replicated parameters on tp rank 0 only (they are equal on all tp ranks), so that
    summing over the tensor-parallel group counts each element of the full model once. Use with
    ``optim.global_grad_norm(grad_norm_params(stage, tp_group), (tp_group, pp_group))``."""
    sharded = {id(p) for p in sharded_parameters(module)}
    everything = tp_rank(group) == 0
    return [p for p in module.parameters() if everything or id(p) in sharded]


def sync_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """With sequence parallelism every *replicated* parameter (LayerNorms, row-parallel biases) sees only
    this rank's sequence chunk, so its gradient is a partial sum: all-reduce those gradients over the
    tensor-parallel group (one coalesced all-reduce; Megatron-LM's ``_allreduce_layernorm_grads``).
    Parameters marked ``tp_grad_whole`` are left out: GPT's position table, added before the token
    embedding's reduce-scatter, gets the whole gradient on every tp rank already (Megatron-LM does not
    reduce it either). Call after the backward (after every W when weight gradients are deferred),
    before the data-parallel reduction. Without sequence parallelism these gradients are already
    identical on every tp rank: do not call it."""
    if tp_size(group) == 1:
        return
    sharded = {id(p) for p in sharded_parameters(module)}
    grads = [
        p.grad
        for p in module.parameters()
        if id(p) not in sharded and p.grad is not None and not getattr(p, "tp_grad_whole", False)
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
