"""Megatron-style tensor parallelism (Narayanan et al., SC21; Shoeybi et al., 2019) as small autograd
Functions and layers over an explicit tensor-parallel process group.

Notation: t = tensor-parallel size (the group's size), r = this rank in the group.

Mappings (all one autograd Function, ``_Mapping``, given a forward and a backward collective):

==========================  ==============================  ==============================
function                    forward                         backward
==========================  ==============================  ==============================
``copy_to``                 identity                        all-reduce
``reduce_from``             all-reduce                      identity
``scatter_to``              keep chunk r of the last dim    all-gather along the last dim
``gather_from``             all-gather along the last dim   keep chunk r of the last dim
``reduce_scatter_to_seq``   reduce-scatter, sequence dim    all-gather, sequence dim
``gather_from_seq``         all-gather, sequence dim        reduce-scatter, sequence dim
``split_for_send``          keep chunk r of the flat tensor all-gather (flat)
``gather_after_recv``       all-gather (flat), reshape      keep chunk r of the flat grad
==========================  ==============================  ==============================

Layers: :class:`ColumnParallelLinear` (Y = X·Aᵀ with A's output rows split: Y_r = X·A_rᵀ),
:class:`RowParallelLinear` (A's input columns split: Y = Σ_r X_r·A_rᵀ, then + b),
:class:`VocabParallelEmbedding` (rows split by vocabulary range) and
:func:`vocab_parallel_cross_entropy`. A transformer layer then costs two all-reduces in the forward
(after attention and after the MLP) and two in the backward (at the inputs of QKV and of the first
MLP linear); with sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather.

Every layer initialises the *full-size* weight exactly as its non-parallel counterpart
(``nn.Linear`` / ``nn.Embedding``) would, from the same generator (or the global RNG), and keeps this
rank's shard: the same seed gives the same model whatever t.

The weight-gradient part of the linear layers is deferrable (Zero Bubble's B = I + W) through
``models/wgrad.py`` (``defer_weight_grads`` / ``WeightGradStore``): see :class:`_LinearFn`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pipewright.errors import ConfigError
from pipewright.models.wgrad import weight_grads

Group = Any  # a torch.distributed ProcessGroup, or None for the default group

__all__ = [
    "LINEAR_KINDS",
    "ColumnParallelLinear",
    "DeferredParams",
    "RowParallelLinear",
    "TensorParallelFactory",
    "VocabParallelEmbedding",
    "copy_to",
    "full_parameters",
    "gather_after_recv",
    "gather_from",
    "gather_from_seq",
    "grad_norm_params",
    "reduce_from",
    "reduce_scatter_to_seq",
    "scatter_to",
    "sequence_chunk",
    "sharded_parameters",
    "split_for_send",
    "sync_sequence_parallel_grads",
    "tp_linear_factory",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]


# --------------------------------------------------------------------------- group helpers


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


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ConfigError(
            f"{what} ({n}) is not divisible by the tensor-parallel size t={t}; choose t dividing it"
        )
    return n // t


# --------------------------------------------------------------------------- raw collectives


def _all_reduce(x: Tensor, group: Group, op: Any = None) -> Tensor:
    """Sum (or ``op``) over the group into a fresh tensor (never mutates ``x``)."""
    if tp_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op or dist.ReduceOp.SUM, group=group)
    return out


def _all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    t = tp_size(group)
    if t == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: Tensor, dim: int, group: Group) -> Tensor:
    """Chunk r of ``x`` along ``dim`` (no communication)."""
    t = tp_size(group)
    if t == 1:
        return x
    n = _divide(x.size(dim), t, f"dimension {dim} of a {tuple(x.shape)} tensor")
    return x.narrow(dim, tp_rank(group) * n, n).contiguous()


def _reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Chunk r along ``dim`` of the sum over the group (older gloo builds lack reduce-scatter: there,
    an all-reduce and a split)."""
    t = tp_size(group)
    if t == 1:
        return x
    n = _divide(x.size(dim), t, f"dimension {dim} of a {tuple(x.shape)} tensor")
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((n, *src.shape[1:]))
    try:
        dist.reduce_scatter_tensor(out, src, group=group)
    except RuntimeError:
        if dist.get_backend(group) != "gloo":
            raise
        return _split(_all_reduce(x, group), dim, group)
    return out.movedim(0, dim).contiguous()


# --------------------------------------------------------------------------- mappings


def _identity(x: Tensor, dim: int, group: Group) -> Tensor:
    return x.view_as(x)


def _reduce(x: Tensor, dim: int, group: Group) -> Tensor:
    return _all_reduce(x, group)


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
    return _Mapping.apply(x, _split, _all_gather, -1, group)


def gather_from(x: Tensor, group: Group) -> Tensor:
    """All-gather along the last dimension; backward keeps this rank's 1/t of the gradient."""
    return _Mapping.apply(x, _all_gather, _split, -1, group)


def reduce_scatter_to_seq(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence parallelism's exit from a tensor-parallel region: reduce-scatter along the sequence
    dimension ``dim`` (1 for [batch, seq, hidden]); backward all-gathers."""
    return _Mapping.apply(x, _reduce_scatter, _all_gather, dim, group)


def gather_from_seq(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence parallelism's entry into a tensor-parallel region: all-gather the sequence chunks along
    ``dim``; backward reduce-scatters the gradient (each rank's partial gradient of the whole sequence)."""
    return _Mapping.apply(x, _all_gather, _reduce_scatter, dim, group)


def sequence_chunk(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """This rank's 1/t of ``x`` along the sequence dimension, as a plain (autograd) slice, no
    communication. For replicated tensors added inside a sequence-parallel region (position
    embeddings): their parameter gradients become partial sums, summed by
    :func:`sync_sequence_parallel_grads`."""
    t = tp_size(group)
    if t == 1:
        return x
    n = _divide(x.size(dim), t, f"the sequence length (dimension {dim})")
    return x.narrow(dim, tp_rank(group) * n, n)


def split_for_send(tensor: Tensor, group: Group) -> Tensor:
    """Megatron's scatter between pipeline stages: this tp rank's 1/t chunk of the flattened stage
    output (every tp rank holds the same full tensor; each sends only its chunk). Backward all-gathers
    the chunks' gradients back to the full shape."""
    _divide(tensor.numel(), tp_size(group), "the number of elements of the stage output")
    return _Mapping.apply(tensor.reshape(-1), _split, _all_gather, 0, group)


def gather_after_recv(chunk: Tensor, group: Group, full_shape: tuple[int, ...] | torch.Size) -> Tensor:
    """Megatron's gather after a pipeline receive: all-gather the t received chunks into ``full_shape``.
    Backward keeps this rank's 1/t chunk of the (flattened) gradient, which is then sent back."""
    if chunk.numel() * tp_size(group) != math.prod(full_shape):
        raise ConfigError(
            f"gather_after_recv: {tp_size(group)} chunks of {chunk.numel()} elements "
            f"do not make {tuple(full_shape)}"
        )
    return _Mapping.apply(chunk.reshape(-1), _all_gather, _split, 0, group).view(full_shape)


# --------------------------------------------------------------------------- linear with separable W


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
    The W pass needs no communication: every collective of a tensor-parallel layer sits in I."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, layer: _ShardedLinear) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        store, key = ctx.layer._defer
        if store is not None:
            store.put(key, ctx.layer.deferred_params, x.detach(), g.detach())
            return grad_x, None, None, None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return grad_x, None, None, None
        grad_w, grad_b = weight_grads(x, g, ctx.needs_input_grad[2])
        return grad_x, grad_w, grad_b, None


# --------------------------------------------------------------------------- sharding helpers


def _shard(full: Tensor, dim: int, rank: int, t: int, blocks: int = 1) -> Tensor:
    """Rank r's part of ``full`` along ``dim``: with ``blocks`` fused equal blocks (QKV: 3), chunk r of
    each block, concatenated (so the local tensor is again ``blocks`` equal blocks)."""
    return torch.cat([blk.chunk(t, dim)[rank] for blk in full.chunk(blocks, dim)], dim).contiguous()


def _unshard(parts: list[Tensor], dim: int, blocks: int = 1) -> Tensor:
    """Inverse of :func:`_shard` given every rank's part in rank order."""
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


class _ShardedLinear(nn.Module):
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
        _divide(split_features, self.tp * blocks, "the split feature count")
        full_w, full_b = _linear_init(out_features, in_features, bias, generator, dtype)
        self.weight = nn.Parameter(self._shard_weight(full_w))
        self.bias = nn.Parameter(self._shard_bias(full_b)) if full_b is not None else None

    def _shard_weight(self, full: Tensor) -> Tensor:
        return _shard(full, self.weight_dim, self.rank, self.tp, self.blocks)

    def _shard_bias(self, full: Tensor) -> Tensor:
        return _shard(full, 0, self.rank, self.tp, self.blocks) if self.bias_sharded else full.clone()

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
        return _unshard(list(_all_gather(src, 0, self.group).chunk(self.tp, 0)), self.weight_dim, self.blocks)

    @torch.no_grad()
    def full_bias(self, grad: bool = False) -> Tensor | None:
        """The full bias (or its gradient); a collective call when the bias is sharded."""
        if self.bias is None:
            return None
        src = self.bias.grad if grad else self.bias
        if not self.bias_sharded:
            return src
        return _unshard(list(_all_gather(src, 0, self.group).chunk(self.tp, 0)), 0, self.blocks)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return _LinearFn.apply(x, self.weight, bias, self)

    @property
    def deferred_params(self) -> DeferredParams:
        """The parameters a deferred W pass updates (the row-parallel bias is outside the linear)."""
        return DeferredParams(self.weight, self.bias if self.bias_sharded else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, t={self.tp}, blocks={self.blocks}"


class ColumnParallelLinear(_ShardedLinear):
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

    def forward(self, x: Tensor) -> Tensor:
        x = gather_from_seq(x, self.group, self.seq_dim) if self.sequence_parallel else copy_to(x, self.group)
        y = self._linear(x, self.bias)
        if not self.gather_output or self.tp == 1:
            return y
        y = gather_from(y, self.group)
        if self.blocks == 1:
            return y
        n = self.out_features // (self.tp * self.blocks)
        lead = y.shape[:-1]
        return y.reshape(*lead, self.tp, self.blocks, n).transpose(-3, -2).reshape(*lead, self.out_features)


class RowParallelLinear(_ShardedLinear):
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


# --------------------------------------------------------------------------- vocabulary parallelism


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over t by vocabulary range: rank r holds ids
    [r·V/t, (r+1)·V/t). Ids outside the range look up row 0 and are masked to zero, then the partial
    embeddings are all-reduced (with ``sequence_parallel``, reduce-scattered along the sequence).
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
        self.per_rank = _divide(num_embeddings, self.tp, "the vocabulary size (pad it to a multiple of t)")
        self.vocab_start = self.rank * self.per_rank
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
        nn.init.normal_(full, generator=generator)
        self.weight = nn.Parameter(_shard(full, 0, self.rank, self.tp))

    @torch.no_grad()
    def load_full_(self, weight: Tensor) -> None:
        """Copy in this rank's rows of a full-size [V, h] table."""
        self.weight.copy_(_shard(weight, 0, self.rank, self.tp))

    @torch.no_grad()
    def full_weight(self, grad: bool = False) -> Tensor:
        """The full [V, h] table (or its gradient) gathered from the group (collective call)."""
        return _all_gather(self.weight.grad if grad else self.weight, 0, self.group)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_seq(out, self.group, self.seq_dim)
        return reduce_from(out, self.group)

    def extra_repr(self) -> str:
        return f"V={self.num_embeddings}, h={self.embedding_dim}, t={self.tp}, rows from {self.vocab_start}"


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (Megatron): three all-reduces —
    global max (stability), target logit, Σ exp. loss = log Σ_v exp(z_v − m) − (z_target − m).
    Backward on the shard: (softmax − one_hot(target)) · grad."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: Group) -> Tensor:
        z = logits.float()
        v_local = z.size(-1)
        z_max = _all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)
        start = tp_rank(group) * v_local
        outside = (targets < start) | (targets >= start + v_local)
        local_t = (targets - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit, group)
        exp = z.exp()
        sum_exp = _all_reduce(exp.sum(-1), group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_t)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        softmax, outside, local_t = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(
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


# --------------------------------------------------------------------------- gradients under SP


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
        if isinstance(m, _ShardedLinear):
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
    """With sequence parallelism every *replicated* parameter (LayerNorms, row-parallel biases, position
    embeddings) sees only this rank's sequence chunk, so its gradient is a partial sum: all-reduce those
    gradients over the tensor-parallel group (one coalesced all-reduce). Call after the backward (after
    every W when weight gradients are deferred), before the data-parallel reduction. Without sequence
    parallelism these gradients are already identical on every tp rank: do not call it."""
    if tp_size(group) == 1:
        return
    sharded = {id(p) for p in sharded_parameters(module)}
    grads = [p.grad for p in module.parameters() if id(p) not in sharded and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# --------------------------------------------------------------------------- the model's factory


def _column(f: TensorParallelFactory, i: int, o: int, bias: bool, blocks: int) -> nn.Module:
    return ColumnParallelLinear(
        i,
        o,
        f.group,
        bias=bias,
        sequence_parallel=f.sequence_parallel,
        seq_dim=f.seq_dim,
        blocks=blocks,
        generator=f.generator,
    )


def _row(f: TensorParallelFactory, i: int, o: int, bias: bool) -> nn.Module:
    return RowParallelLinear(
        i,
        o,
        f.group,
        bias=bias,
        sequence_parallel=f.sequence_parallel,
        seq_dim=f.seq_dim,
        generator=f.generator,
    )


# kind -> builder(factory, in_features, out_features, bias). QKV is three fused blocks (q; k; v).
LINEAR_KINDS: Mapping[str, Callable[[TensorParallelFactory, int, int, bool], nn.Module]] = MappingProxyType(
    {
        "qkv": lambda f, i, o, b: _column(f, i, o, b, 3),
        "mlp_in": lambda f, i, o, b: _column(f, i, o, b, 1),
        "output": lambda f, i, o, b: _column(f, i, o, b, 1),
        "attn_out": _row,
        "mlp_out": _row,
    }
)


class TensorParallelFactory:
    """The ``linear_factory(in_features, out_features, *, bias, kind)`` a GPT model calls, building
    Megatron's layout over ``group``:

    - ``qkv`` → column-parallel with three fused blocks: rank r gets the q, k and v rows of heads
      [r·a/t, (r+1)·a/t); the local output is [q_r; k_r; v_r], each of width h/t. The model must split
      it into three equal parts and view heads as ``(..., -1, head_dim)`` (a/t local heads);
      a must be divisible by t (``num_heads`` is checked here; :meth:`local_heads` checks too).
    - ``attn_out`` → row-parallel (input: the local heads' outputs, width h/t).
    - ``mlp_in`` → column-parallel (ffn/t), ``mlp_out`` → row-parallel.
    - ``output`` → column-parallel over the vocabulary (logits shard [..., V/t]); compute the loss with
      :meth:`cross_entropy` (vocab-parallel, three all-reduces).

    With ``sequence_parallel`` the activations between the tensor-parallel regions (LayerNorms,
    dropout, residuals) hold this rank's 1/t of the sequence (dimension ``seq_dim``); the model adds
    position embeddings through :meth:`sequence_chunk` and the trainer calls
    :func:`sync_sequence_parallel_grads` after the backward. The linears' weight gradients are
    deferrable exactly like ``DeferrableLinear``'s (see :class:`_LinearFn`).
    """

    def __init__(
        self,
        group: Group,
        *,
        sequence_parallel: bool = False,
        num_heads: int | None = None,
        seq_dim: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        self.group, self.sequence_parallel, self.seq_dim = group, sequence_parallel, seq_dim
        self.generator = generator
        self.tp = tp_size(group)
        if num_heads is not None:
            self.local_heads(num_heads)

    def __call__(self, in_features: int, out_features: int, *, bias: bool, kind: str) -> nn.Module:
        try:
            build = LINEAR_KINDS[kind]
        except KeyError:
            raise ConfigError(
                f"unknown linear kind {kind!r}; expected one of {sorted(LINEAR_KINDS)}"
            ) from None
        return build(self, in_features, out_features, bias)

    def local_heads(self, num_heads: int) -> int:
        """a/t, the attention heads on this rank; a one-line error when t does not divide a."""
        if num_heads % self.tp:
            raise ConfigError(
                f"attention heads ({num_heads}) are not divisible by the tensor-parallel size t={self.tp}; "
                "choose t dividing the head count"
            )
        return num_heads // self.tp

    def embedding(self, num_embeddings: int, embedding_dim: int) -> VocabParallelEmbedding:
        """The token embedding, split over the vocabulary."""
        return VocabParallelEmbedding(
            num_embeddings,
            embedding_dim,
            self.group,
            sequence_parallel=self.sequence_parallel,
            seq_dim=self.seq_dim,
            generator=self.generator,
        )

    def cross_entropy(self, logits_shard: Tensor, targets: Tensor, **kwargs: Any) -> Tensor:
        """The loss of the ``output`` layer's logits shard (see :func:`vocab_parallel_cross_entropy`)."""
        return vocab_parallel_cross_entropy(logits_shard, targets, self.group, **kwargs)

    def sequence_chunk(self, x: Tensor) -> Tensor:
        """This rank's sequence chunk of a replicated tensor (identity without sequence parallelism)."""
        return sequence_chunk(x, self.group, self.seq_dim) if self.sequence_parallel else x


def tp_linear_factory(group: Group, sequence_parallel: bool = False, **kwargs: Any) -> TensorParallelFactory:
    """The factory the GPT model calls for every Linear (see :class:`TensorParallelFactory`)."""
    return TensorParallelFactory(group, sequence_parallel=sequence_parallel, **kwargs)
