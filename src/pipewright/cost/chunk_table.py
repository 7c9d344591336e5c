"""The per-microbatch costs of one pipeline chunk, the table an analytical cost model builds per chunk
(:meth:`pipewright.cost.transformer.TransformerCost.chunk_costs`) and every pricing method reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkCosts:
    """Per-microbatch costs of one chunk, per device (tensor- and context-parallel share)."""

    flops: Mapping[str, float]  # F, B, I, W executed (recomputation included)
    model_flops: Mapping[str, float]  # without recomputation
    tp_bytes: Mapping[str, tuple[float, ...]]  # all-reduce sizes per kind
    traffic: Mapping[str, float]  # bytes the memory-bound kernels move per kind
    memory: Mapping[str, float]
    params: float
    gemms: Mapping[str, tuple[tuple[float, float, float, int], ...]] = field(default_factory=dict)
    attention: Mapping[str, float] = field(default_factory=dict)  # attention-core FLOPs executed
    ring_bytes: Mapping[str, float] = field(default_factory=dict)  # context-parallel exchange, per layer
    layers: int = 0
    moe_layers: int = 0  # of ``layers``, those with experts (cost/moe_cost.py)
    first: bool = False  # holds the embedding
    last: bool = False  # holds the output layer and the loss
    ends: tuple[ChunkCosts, ...] | None = None  # its embedding and head alone, each a piece (dispatch.py)
