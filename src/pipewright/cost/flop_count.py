"""Whole-model counts as Megatron-LM states them: the output layer's forward FLOPs, an iteration's FLOPs
(Narayanan et al., SC21, eq. 3) and the parameter count; the per-layer counts are
:mod:`pipewright.cost.layer`'s."""

from __future__ import annotations

from pipewright.models.spec import ModelSpec


def logit_forward_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of the output layer: 2·b·s·h·V."""
    return 2 * b * spec.seq_len * spec.hidden * spec.vocab


def megatron_flops_per_iteration(spec: ModelSpec, global_batch: int, recompute: str = "full") -> float:
    """Megatron-LM (SC21, eq. 3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation,
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without."""
    B, s, l, h, V = global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    if recompute == "full":
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_parameters(spec: ModelSpec) -> float:
    """Megatron-LM: 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
