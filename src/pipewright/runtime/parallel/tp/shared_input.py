"""One input shared by a block's column-parallel linears (Megatron's fused QKV and gate/up, kept as
separate layers): the sequence-parallel input is all-gathered once in the forward, once again in the
backward for all their weight gradients, and their input gradients are summed before one
reduce-scatter (without sequence parallelism: before one all-reduce). Unfused, each of k linears does
each of those itself: 3k activation-sized collectives a block where Megatron runs 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import Tensor

from pipewright.runtime.parallel.tp.ops import Group, all_gather, copy_to, gather_from_seq


class SharedGather:
    """The backward's re-gather of one sequence chunk for every linear that read it: the first call
    all-gathers, the rest (``uses`` in all, one per linear's forward) reuse it; the gathered tensor is
    dropped after the last (Korthikanti et al., 2022, §4.2.2: between the passes only the 1/t chunk
    is kept)."""

    def __init__(self, dim: int, group: Group) -> None:
        self.dim, self.group = dim, group
        self.uses = 0
        self._full: Tensor | None = None

    def take(self) -> None:
        """One more linear will need the gathered input in its backward."""
        self.uses += 1

    def __call__(self, chunk: Tensor) -> Tensor:
        full = self._full if self._full is not None else all_gather(chunk, self.dim, self.group)
        self.release()
        if self.uses > 0:
            self._full = full
        return full

    def release(self) -> None:
        """One linear's use is over (called or skipped: a frozen weight needs no gathered input)."""
        self.uses -= 1
        if self.uses <= 0:
            self._full = None


class SharedInput(NamedTuple):
    """What :func:`share_input` hands each linear: the tensor it will be called with (identity
    checked), the re-gather shared in the backward and the sequence chunk it re-gathers (both None
    without sequence parallelism)."""

    tensor: Tensor
    gather: SharedGather | None
    chunk: Tensor | None


def _shareable(layers: Sequence[Any]) -> bool:
    lead = layers[0]
    same = ("group", "sequence_parallel", "seq_dim", "tp")
    return lead.tp > 1 and all(
        not getattr(m, "gather_output", True) and all(getattr(m, a, None) == getattr(lead, a) for a in same)
        for m in layers
    )


def share_input(x: Tensor, layers: Sequence[Any]) -> Tensor:
    """The tensor ``layers`` (column-parallel linears of one group reading ``x``) are then called with:
    with sequence parallelism, ``x`` all-gathered along the sequence once (backward: one reduce-scatter
    of the summed input gradients); without, ``x`` entering the tensor-parallel region once (backward:
    one all-reduce). Layers that cannot share (t = 1, different groups, a gathered output): ``x``."""
    if not _shareable(layers):
        return x
    lead = layers[0]
    if lead.sequence_parallel:
        shared = SharedInput(
            gather_from_seq(x, lead.group, lead.seq_dim), SharedGather(lead.seq_dim, lead.group), x
        )
    else:
        shared = SharedInput(copy_to(x, lead.group), None, None)
    for m in layers:
        m._shared = shared
    return shared.tensor
