"""Tensor-parallel communication: the group helpers, the raw collectives over a tensor-parallel group and
Megatron's mappings (one autograd Function, ``_Mapping``, given a forward and a backward collective):

==========================  ==============================  ==============================
function                    forward                         backward
==========================  ==============================  ==============================
``copy_to``                 identity                        all-reduce
``reduce_from``             all-reduce                      identity
``scatter_to``              keep chunk r of the last dim    all-gather along the last dim
``gather_from``             all-gather along the last dim   keep chunk r of the last dim
``reduce_scatter_to_seq``   reduce-scatter, sequence dim    all-gather, sequence dim
``gather_from_seq``         all-gather, sequence dim        reduce-scatter, sequence dim
``count_once``              x on rank 0, zeros elsewhere    identity
``split_for_send``          keep chunk r of the flat tensor all-gather (flat)
``gather_after_recv``       all-gather (flat), reshape      keep chunk r of the flat grad
==========================  ==============================  ==============================

t = tensor-parallel size (the group's size), r = this rank in the group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipewright.errors import ConfigError

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


def tp_size(group: Group) -> int:
    """t: the size of ``group`` (1 when torch.distributed is not initialised and group is None)."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def tp_rank(group: Group) -> int:
    """r: this process's rank inside ``group``."""
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def divide(n: int, t: int, what: str) -> int:
    """n / t; a one-line ConfigError naming ``what`` when t does not divide n."""
    if n % t:
        raise ConfigError(
            f"{what} ({n}) is not divisible by the tensor-parallel size t={t}; choose t dividing it"
        )
    return n // t


# -- raw collectives


def all_reduce(x: Tensor, group: Group, op: Any = None) -> Tensor:
    """Sum (or ``op``) over the group into a fresh tensor (never mutates ``x``)."""
    if tp_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op or dist.ReduceOp.SUM, group=group)
    return out


def all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    t = tp_size(group)
    if t == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def split(x: Tensor, dim: int, group: Group) -> Tensor:
    """Chunk r of ``x`` along ``dim`` (no communication)."""
    t = tp_size(group)
    if t == 1:
        return x
    n = divide(x.size(dim), t, f"dimension {dim} of a {tuple(x.shape)} tensor")
    return x.narrow(dim, tp_rank(group) * n, n).contiguous()


# torch 2.13 deprecates reduce_scatter_tensor (a FutureWarning per call) for reduce_scatter_single, which
# older releases (>= 2.4, supported here) lack
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Chunk r along ``dim`` of the sum over the group (older gloo builds lack reduce-scatter: there,
    an all-reduce and a split)."""
    t = tp_size(group)
    if t == 1:
        return x
    n = divide(x.size(dim), t, f"dimension {dim} of a {tuple(x.shape)} tensor")
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((n, *src.shape[1:]))
    try:
        _reduce_scatter_single(out, src, group=group)
    except RuntimeError:
        if dist.get_backend(group) != "gloo":
            raise
        return split(all_reduce(x, group), dim, group)
    return out.movedim(0, dim).contiguous()


# -- mappings


def _identity(x: Tensor, dim: int, group: Group) -> Tensor:
    return x.view_as(x)


def _reduce(x: Tensor, dim: int, group: Group) -> Tensor:
    return all_reduce(x, group)


Collective = Callable[[Tensor, int, Group], Tensor]


class _Mapping(torch.autograd.Function):
    """One autograd Function for every mapping: ``fwd`` in the forward, ``bwd`` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd: Collective, bwd: Collective, dim: int, group: Group) -> Tensor:
        ctx.bwd, ctx.dim, ctx.group = bwd, dim, group
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        return ctx.bwd(g, ctx.dim, ctx.group), None, None, None, None


def copy_to(x: Tensor, group: Group) -> Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient (Megatron's f)."""
    return _Mapping.apply(x, _identity, _reduce, -1, group)


def reduce_from(x: Tensor, group: Group) -> Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward (Megatron's g)."""
    return _Mapping.apply(x, _reduce, _identity, -1, group)


def scatter_to(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's 1/t of the last dimension; backward all-gathers it."""
    return _Mapping.apply(x, split, all_gather, -1, group)


def gather_from(x: Tensor, group: Group) -> Tensor:
    """All-gather along the last dimension; backward keeps this rank's 1/t of the gradient."""
    return _Mapping.apply(x, all_gather, split, -1, group)


def reduce_scatter_to_seq(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence parallelism's exit from a tensor-parallel region: reduce-scatter along the sequence
    dimension ``dim`` (1 for [batch, seq, hidden]); backward all-gathers."""
    return _Mapping.apply(x, reduce_scatter, all_gather, dim, group)


def gather_from_seq(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence parallelism's entry into a tensor-parallel region: all-gather the sequence chunks along
    ``dim``; backward reduce-scatters the gradient (each rank's partial gradient of the whole sequence)."""
    return _Mapping.apply(x, all_gather, reduce_scatter, dim, group)


def _first_rank_only(x: Tensor, dim: int, group: Group) -> Tensor:
    return x if tp_rank(group) == 0 else torch.zeros_like(x)


def count_once(x: Tensor, group: Group) -> Tensor:
    """A replicated tensor added into partial sums just before their reduction over the group
    (``reduce_from`` or ``reduce_scatter_to_seq``): kept on rank 0, zeros on the others, so the reduced
    sum holds it once. Backward is the identity: the reduction's backward hands every rank the whole
    gradient (identity, or all-gather of the sequence chunks), so ``x``'s gradient is already whole and
    equal on every rank — a position table added this way needs no gradient all-reduce over tp."""
    return _Mapping.apply(x, _first_rank_only, _identity, -1, group)


def split_for_send(tensor: Tensor, group: Group) -> Tensor:
    """Megatron's scatter between pipeline stages: this tp rank's 1/t chunk of the flattened stage
    output (every tp rank holds the same full tensor; each sends only its chunk). Backward all-gathers
    the chunks' gradients back to the full shape."""
    divide(tensor.numel(), tp_size(group), "the number of elements of the stage output")
    return _Mapping.apply(tensor.reshape(-1), split, all_gather, 0, group)


def gather_after_recv(chunk: Tensor, group: Group, full_shape: tuple[int, ...] | torch.Size) -> Tensor:
    """Megatron's gather after a pipeline receive: all-gather the t received chunks into ``full_shape``.
    Backward keeps this rank's 1/t chunk of the (flattened) gradient, which is then sent back."""
    if chunk.numel() * tp_size(group) != math.prod(full_shape):
        raise ConfigError(
            f"gather_after_recv: {tp_size(group)} chunks of {chunk.numel()} elements "
            f"do not make {tuple(full_shape)}"
        )
    return _Mapping.apply(chunk.reshape(-1), all_gather, split, 0, group).view(full_shape)
