"""Megatron's column- and row-parallel linear layers (Narayanan et al., SC21; Shoeybi et al., 2019).

:class:`ColumnParallelLinear`: Y = X·Aᵀ with A's output rows split, Y_r = X·A_rᵀ;
:class:`RowParallelLinear`: A's input columns split, Y = Σ_r X_r·A_rᵀ, then + b. Every layer
initialises the *full-size* weight exactly as ``nn.Linear`` would, from the same generator (or the
global RNG), and keeps this rank's shard: the same seed gives the same model whatever t. The
weight-gradient part is deferrable (Zero Bubble's B = I + W) through ``models/wgrad.py``
(``defer_weight_grads`` / ``WeightGradStore``): see :class:`_LinearFn`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipewright.models.wgrad import WeightInput, weight_grads, weight_input
from pipewright.runtime.parallel.tp.ops import (
    Group,
    all_gather,
    copy_to,
    divide,
    gather_from,
    reduce_from,
    reduce_scatter,
    reduce_scatter_to_seq,
    scatter_to,
    tp_rank,
    tp_size,
)
from pipewright.runtime.parallel.tp.shared_input import SharedGather, SharedInput, share_input


class DeferredParams(NamedTuple):
    """What a deferred W pass updates: ``weight`` and, when it is inside the linear, ``bias``."""

    weight: nn.Parameter
    bias: nn.Parameter | None


class _LinearFn(torch.autograd.Function):
    """Y = X·Wᵀ + b whose backward computes grad X (the I pass) and either the parameter gradients at
    once (a full B) or, while ``layer._defer`` is ``(store, key)`` with a store, calls
    ``store.put(key, layer.deferred_params, x, grad_out)`` so that the store's W pass computes
    ∂L/∂W = grad_outᵀ·X (and ∂L/∂b) later: the protocol of ``models/wgrad.py``'s DeferrableLinear, so
    ``defer_weight_grads(store, module, key=k)`` and ``store.flush(k)`` drive these layers too.

    With ``seq_gather`` (a column-parallel linear under sequence parallelism) the input is this rank's
    1/t sequence chunk: the forward all-gathers it along ``layer.seq_dim`` and keeps only the chunk for
    backward; the backward reduce-scatters grad X and all-gathers the chunk again for ∂L/∂W — at once
    in a full B, when the W pass runs in a split one (Korthikanti et al., 2022, §4.2.2: the layer's
    stored input is sbh/t, not sbh). Without it the W pass needs no communication. With ``shared`` (a
    :class:`~pipewright.runtime.parallel.tp.shared_input.SharedGather`) the input is already gathered
    for a group of linears (q, k, v): this one keeps ``chunk``, leaves the reduce-scatter of grad X to
    the group's gather, and its W pass takes the group's one re-gather."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        layer: ShardedLinear,
        seq_gather: bool,
        shared: SharedGather | None = None,
        chunk: Tensor | None = None,
    ) -> Tensor:
        # with ``shared``, x is the block's input already gathered (shared_input.py); keep its chunk
        ctx.save_for_backward(x if shared is None else chunk, weight)
        ctx.layer, ctx.seq_gather, ctx.shared = layer, seq_gather, shared
        if shared is not None:
            shared.take()
        if seq_gather:
            x = all_gather(x, layer.seq_dim, layer.group)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.seq_gather and grad_x is not None:
            grad_x = reduce_scatter(grad_x, layer.seq_dim, layer.group)
        none = (None,) * 4
        store, key = layer._defer
        if store is not None:
            store.put(key, layer.deferred_params, _weight_input(ctx, x.detach()), g.detach())
            return grad_x, None, None, *none
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            if ctx.shared is not None:
                ctx.shared.release()
            return grad_x, None, None, *none
        grad_w, grad_b = weight_grads(weight_input(_weight_input(ctx, x)), g, ctx.needs_input_grad[2])
        return grad_x, grad_w, grad_b, *none


def _weight_input(ctx: Any, x: Tensor) -> WeightInput:
    """The W pass's input: ``x``, or the sequence-gathered ``x`` made when W runs (once for every
    linear sharing the input)."""
    if ctx.shared is not None:
        return partial(ctx.shared, x)
    if not ctx.seq_gather:
        return x
    layer = ctx.layer
    return partial(all_gather, x, layer.seq_dim, layer.group)


def shard(full: Tensor, dim: int, rank: int, t: int, blocks: int = 1) -> Tensor:
    """Rank r's part of ``full`` along ``dim``: with ``blocks`` fused equal blocks (QKV: 3), chunk r of
    each block, concatenated (so the local tensor is again ``blocks`` equal blocks)."""
    return torch.cat([blk.chunk(t, dim)[rank] for blk in full.chunk(blocks, dim)], dim).contiguous()


def unshard(parts: list[Tensor], dim: int, blocks: int = 1) -> Tensor:
    """Inverse of :func:`shard` given every rank's part in rank order."""
    split = [p.chunk(blocks, dim) for p in parts]
    return torch.cat([torch.cat([s[j] for s in split], dim) for j in range(blocks)], dim)


def _linear_init(
    out_features: int, in_features: int, bias: bool, generator: torch.Generator | None, dtype: Any
) -> tuple[Tensor, Tensor | None]:
    """nn.Linear's default initialisation of the full-size weight and bias, drawing from the RNG in the
    same order (weight, then bias): Kaiming-uniform with a = √5, bias U(−1/√in, 1/√in)."""
    w = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
    if not bias:
        return w, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
    b = torch.empty(out_features, dtype=dtype)
    nn.init.uniform_(b, -bound, bound, generator=generator)
    return w, b


class ShardedLinear(nn.Module):
    """Shared parts of column- and row-parallel linears: full-size init, shard bookkeeping, gather."""

    weight_dim: int  # the weight dimension split over t (0: output rows, 1: input columns)
    bias_sharded: bool

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        bias: bool,
        blocks: int,
        generator: torch.Generator | None,
        dtype: Any,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.blocks = group, blocks
        self.tp, self.rank = tp_size(group), tp_rank(group)
        self._defer: tuple[Any, Any] = (None, None)  # (weight-grad store, key) while W is deferred
        split_features = out_features if self.weight_dim == 0 else in_features
        divide(split_features, self.tp * blocks, "the split feature count")
        full_w, full_b = _linear_init(out_features, in_features, bias, generator, dtype)
        self.weight = nn.Parameter(self._shard_weight(full_w))
        self.bias = nn.Parameter(self._shard_bias(full_b)) if full_b is not None else None

    def _shard_weight(self, full: Tensor) -> Tensor:
        return shard(full, self.weight_dim, self.rank, self.tp, self.blocks)

    def _shard_bias(self, full: Tensor) -> Tensor:
        return shard(full, 0, self.rank, self.tp, self.blocks) if self.bias_sharded else full.clone()

    @torch.no_grad()
    def load_full_(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy in this rank's shard of a full-size [out, in] ``weight`` (and [out] ``bias``): how a model
        that initialises full-size tensors (``models/gpt.py``) initialises a sharded layer."""
        self.weight.copy_(self._shard_weight(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(self._shard_bias(bias))

    @torch.no_grad()
    def full_weight(self, grad: bool = False) -> Tensor:
        """The full [out, in] weight (or its gradient) gathered from the group (collective call)."""
        src = self.weight.grad if grad else self.weight
        return unshard(list(all_gather(src, 0, self.group).chunk(self.tp, 0)), self.weight_dim, self.blocks)

    @torch.no_grad()
    def full_bias(self, grad: bool = False) -> Tensor | None:
        """The full bias (or its gradient); a collective call when the bias is sharded."""
        if self.bias is None:
            return None
        src = self.bias.grad if grad else self.bias
        if not self.bias_sharded:
            return src
        return unshard(list(all_gather(src, 0, self.group).chunk(self.tp, 0)), 0, self.blocks)

    def _linear(self, x: Tensor, bias: Tensor | None, seq_gather: bool = False) -> Tensor:
        return _LinearFn.apply(x, self.weight, bias, self, seq_gather)

    @property
    def deferred_params(self) -> DeferredParams:
        """The parameters a deferred W pass updates (the row-parallel bias is outside the linear)."""
        return DeferredParams(self.weight, self.bias if self.bias_sharded else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, t={self.tp}, blocks={self.blocks}"


class ColumnParallelLinear(ShardedLinear):
    """Y = X·Aᵀ + b with A's output rows (and b) split over t: rank r computes Y_r = X·A_rᵀ + b_r.

    Input: the full activation (replicated over the group), or with ``sequence_parallel`` this rank's
    sequence chunk, all-gathered first. Backward all-reduces (or reduce-scatters) grad X.
    ``gather_output`` all-gathers Y; otherwise the output is this rank's 1/t of the features.
    ``blocks`` > 1 treats the output as that many fused equal blocks (QKV: 3) each split over t, so the
    local output is again ``blocks`` equal blocks (local q, k, v of this rank's heads).
    """

    weight_dim = 0
    bias_sharded = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        blocks: int = 1,
        generator: torch.Generator | None = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(in_features, out_features, group, bias, blocks, generator, dtype)
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        self._shared: SharedInput | None = None  # set by share_input for the next call

    share_input = staticmethod(share_input)  # the hook models' shared_input calls (shared_input.py)

    def forward(self, x: Tensor) -> Tensor:
        shared, self._shared = self._shared, None
        if shared is not None and shared.tensor is x:  # gathered / entered once for the block
            y = _LinearFn.apply(x, self.weight, self.bias, self, False, shared.gather, shared.chunk)
        elif self.sequence_parallel:  # the gather happens inside, keeping only the chunk for backward
            y = self._linear(x, self.bias, seq_gather=self.tp > 1)
        else:
            y = self._linear(copy_to(x, self.group), self.bias)
        if not self.gather_output or self.tp == 1:
            return y
        y = gather_from(y, self.group)
        if self.blocks == 1:
            return y
        n = self.out_features // (self.tp * self.blocks)
        lead = y.shape[:-1]
        return y.reshape(*lead, self.tp, self.blocks, n).transpose(-3, -2).reshape(*lead, self.out_features)


class RowParallelLinear(ShardedLinear):
    """Y = X·Aᵀ + b with A's input columns split over t: Y = Σ_r X_r·A_rᵀ, summed by an all-reduce (or,
    with ``sequence_parallel``, a reduce-scatter along the sequence), then + b (b replicated, added
    after the reduction as in Megatron). Input: this rank's 1/t of the features (``input_is_parallel``),
    or the full input, scattered first."""

    weight_dim = 1
    bias_sharded = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        generator: torch.Generator | None = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(in_features, out_features, group, bias, 1, generator, dtype)
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = (
            input_is_parallel,
            sequence_parallel,
            seq_dim,
        )

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.group)
        y = self._linear(x, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_seq(y, self.group, self.seq_dim)
        else:
            y = reduce_from(y, self.group)
        return y + self.bias if self.bias is not None else y
