"""The context-parallel ring's attention FLOPs counted in the simulator's convention.

The ring (:mod:`pipewright.runtime.parallel.cp.ring`) computes, per rank, only the key-query pairs the causal
mask keeps, with the load-balanced chunk layout: its causal diagonal block and, per other rank, one
block of half the pairs of the two chunks' square (2c² of 4c²). Counted op by op, that is about half of
what the same attention counts without context parallelism, where ``torch.utils.flop_counter`` prices
``F.scaled_dot_product_attention`` over the full s × s square, causal or not (the simulator's
convention: the MFU formulas' 4·b·s²·h a layer, / cp per rank). While measuring, each ring block is
counted as that convention's share instead of its matmuls: forward 4·b·a·n·m·d for a causal diagonal
block of n queries and m keys, twice that for an off-diagonal one (its half of the pair of blocks),
backward 2.5 × the forward (the scores recomputed, as ``sdpa_backward_flop`` counts). Per rank that
sums to 4·b·a·d·(s/cp)·s, the full square / cp.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: backward FLOPs / forward FLOPs of an attention block (QKᵀ recomputed, dV, dP, dQ, dK)
BACKWARD_RATIO = 2.5


def block_flops(q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    """Forward FLOPs of one ring block in the full-square convention (module docstring)."""
    *lead, n, d = q.shape
    batch_heads = 1
    for x in lead:
        batch_heads *= x
    return 4 * batch_heads * n * k.shape[-2] * d * (1 if causal else 2)


@contextmanager
def counted_in_convention(tracker) -> Iterator[None]:
    """While active, the ring's block computations add :func:`block_flops` (× 2.5 backward) to
    ``tracker``'s current action kind instead of their matmuls."""
    from pipewright.runtime.parallel.cp import ring

    forward, backward = ring.block_forward, ring.block_backward

    def _uncounted(fn, flops, *args):
        counting, tracker.counting = tracker.counting, False
        try:
            return fn(*args)
        finally:
            tracker.counting = counting
            if counting:
                tracker.flops[tracker.kind] += flops

    def block_forward(q, k, v, causal, scale):
        return _uncounted(forward, block_flops(q, k, causal), q, k, v, causal, scale)

    def block_backward(q, k, v, d_out, delta, lse, causal, scale):
        flops = int(BACKWARD_RATIO * block_flops(q, k, causal))
        return _uncounted(backward, flops, q, k, v, d_out, delta, lse, causal, scale)

    ring.block_forward, ring.block_backward = block_forward, block_backward
    try:
        yield
    finally:
        ring.block_forward, ring.block_backward = forward, backward
