"""The linear-layer factory a GPT model calls to build Megatron's tensor-parallel layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from pipewright.errors import ConfigError
from pipewright.runtime.parallel.tp.ops import Group, tp_size
from pipewright.runtime.parallel.tp.parallel_linears import ColumnParallelLinear, RowParallelLinear
from pipewright.runtime.parallel.tp.vocab import VocabParallelEmbedding, sharded_vocab_cross_entropy


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
    dropout, residuals) hold this rank's 1/t of the sequence (dimension ``seq_dim``); the model hands
    the whole position embeddings to the token embedding (``embedding(ids, add)``), which adds them
    before its reduce-scatter, and the trainer calls :func:`sync_sequence_parallel_grads` after the
    backward. The linears' weight gradients are
    deferrable exactly like ``DeferrableLinear``'s (see
    :class:`pipewright.runtime.parallel.tp.parallel_linears._LinearFn`).
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
        """The loss of the ``output`` layer's logits shard (see :func:`sharded_vocab_cross_entropy`)."""
        return sharded_vocab_cross_entropy(logits_shard, targets, self.group, **kwargs)


def tp_linear_factory(group: Group, sequence_parallel: bool = False, **kwargs: Any) -> TensorParallelFactory:
    """The factory the GPT model calls for every Linear (see :class:`TensorParallelFactory`)."""
    return TensorParallelFactory(group, sequence_parallel=sequence_parallel, **kwargs)
