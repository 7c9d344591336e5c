"""Context parallelism: the sequence split over a ``cp`` mesh dimension, ring attention with causal load
balancing (:mod:`.ring`), and its application to stages, batches and gradients (:mod:`.sequence_split`)."""

from pipewright.runtime.parallel.cp.ring import DistRing, RingAttention, RingAttentionCore
from pipewright.runtime.parallel.cp.sequence_split import (
    ContextParallel,
    apply_context_parallel,
    check_context_parallel,
    local_positions,
    shard_sequence,
    sync_context_parallel_grads,
)

__all__ = [
    "ContextParallel",
    "DistRing",
    "RingAttention",
    "RingAttentionCore",
    "apply_context_parallel",
    "check_context_parallel",
    "local_positions",
    "shard_sequence",
    "sync_context_parallel_grads",
]
