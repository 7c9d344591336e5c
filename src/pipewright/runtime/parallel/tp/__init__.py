"""Megatron-style tensor parallelism (Narayanan et al., SC21; Shoeybi et al., 2019) as small autograd
Functions and layers over an explicit tensor-parallel process group.

Notation: t = tensor-parallel size (the group's size), r = this rank in the group.

Mappings (``copy_to``, ``reduce_from``, ``scatter_to``, ``gather_from``, the sequence-parallel pair and the
split send/receive pair; one autograd Function given a forward and a backward collective): the table in
:mod:`.ops`.

Layers: :class:`ColumnParallelLinear` (Y = X·Aᵀ with A's output rows split: Y_r = X·A_rᵀ),
:class:`RowParallelLinear` (A's input columns split: Y = Σ_r X_r·A_rᵀ, then + b),
:class:`VocabParallelEmbedding` (rows split by vocabulary range) and
:func:`sharded_vocab_cross_entropy`. A transformer layer then costs two all-reduces in the forward
(after attention and after the MLP) and two in the backward (at the inputs of QKV and of the first
MLP linear); with sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather.

Every layer initialises the *full-size* weight exactly as its non-parallel counterpart
(``nn.Linear`` / ``nn.Embedding``) would, from the same generator (or the global RNG), and keeps this
rank's shard: the same seed gives the same model whatever t.

The weight-gradient part of the linear layers is deferrable (Zero Bubble's B = I + W) through
``models/wgrad.py`` (``defer_weight_grads`` / ``WeightGradStore``): see :class:`_LinearFn`.

Modules: :mod:`.ops` (group helpers, collectives, the mappings above), :mod:`.parallel_linears` (column/row
parallel linears), :mod:`.shared_input` (one gather shared by a block's column-parallel linears that
read the same input, as Megatron's fused QKV and gate/up), :mod:`.vocab` (vocabulary-parallel embedding
and cross-entropy), :mod:`.grads` (sharded/full parameters, gradient norm share, sequence-parallel
gradient sync), :mod:`.factory` (the linear factory a GPT model calls).
"""

from __future__ import annotations

from pipewright.runtime.parallel.tp.factory import LINEAR_KINDS, TensorParallelFactory, tp_linear_factory
from pipewright.runtime.parallel.tp.grads import (
    full_parameters,
    grad_norm_params,
    sharded_parameters,
    sync_sequence_parallel_grads,
)
from pipewright.runtime.parallel.tp.ops import (
    copy_to,
    count_once,
    gather_after_recv,
    gather_from,
    gather_from_seq,
    reduce_from,
    reduce_scatter_to_seq,
    scatter_to,
    split_for_send,
    tp_rank,
    tp_size,
)
from pipewright.runtime.parallel.tp.parallel_linears import (
    ColumnParallelLinear,
    DeferredParams,
    RowParallelLinear,
)
from pipewright.runtime.parallel.tp.vocab import VocabParallelEmbedding, sharded_vocab_cross_entropy

__all__ = [
    "LINEAR_KINDS",
    "ColumnParallelLinear",
    "DeferredParams",
    "RowParallelLinear",
    "TensorParallelFactory",
    "VocabParallelEmbedding",
    "copy_to",
    "count_once",
    "full_parameters",
    "gather_after_recv",
    "gather_from",
    "gather_from_seq",
    "grad_norm_params",
    "reduce_from",
    "reduce_scatter_to_seq",
    "scatter_to",
    "sharded_parameters",
    "sharded_vocab_cross_entropy",
    "split_for_send",
    "sync_sequence_parallel_grads",
    "tp_linear_factory",
    "tp_rank",
    "tp_size",
]
