"""Context parallelism: ring attention over the cp group (Liu et al. 2023; Megatron-LM's CP).

Each of the c ranks of a context-parallel group holds s/c tokens of every sequence (2·c chunks, rank i
holding chunks i and 2c − 1 − i, so the causal work is balanced: the sequence must split into 2·c equal
chunks). Every layer's attention runs c steps; at each step a rank computes its queries against the
key/value block it holds and passes that block to its ring neighbour: c − 1 transfers of
2·b·(s/c)·g·d/t elements (K and V) per layer in the forward, the backward twice that (the K/V blocks
and their gradients). The transfers overlap the block computations, so only what exceeds the
attention core's time is exposed. Everything else in the layer (GEMMs, norms, activations) is per
token and divides by c; the attention FLOPs divide by c too (the balanced split). Gradients are
reduced over the dp × cp replicas.
"""

from __future__ import annotations

from pipewright.cost.layer import kv_width
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec


def check_context_parallel(spec: ModelSpec, cp: int) -> None:
    """One-line ConfigError unless cp ≥ 1 splits the sequence into 2·cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"--cp must be at least 1 (got {cp})")
    if cp > 1 and spec.seq_len % (2 * cp):
        raise ConfigError(
            f"--cp {cp} needs a sequence length divisible by 2 × cp = {2 * cp} (got {spec.seq_len}); "
            "ring attention splits each sequence into 2·cp chunks"
        )


def ring_bytes_per_layer(spec: ModelSpec, b: int, cp: int, t: int, element_bytes: int) -> dict[str, float]:
    """Bytes one rank sends around the ring per layer and microbatch, per kind (module docstring)."""
    if cp <= 1:
        return {F: 0.0, I: 0.0, W: 0.0, B: 0.0}
    kv = 2 * b * (spec.seq_len / cp) * kv_width(spec) / t * element_bytes
    fwd = (cp - 1) * kv
    return {F: fwd, I: 2 * fwd, W: 0.0, B: 2 * fwd}
