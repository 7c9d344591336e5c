"""The attention block of a decoder layer, by kind: a registry the cost model reads through the spec.

A :class:`~pipewright.models.spec.ModelSpec` names its attention kind (``attention_kind``, "mha" by
default); :func:`attention_of` returns the :class:`AttentionKind` that prices it. Each kind gives, per
layer (b sequences of length s, hidden h, a heads, tensor-parallel size t, T tokens on a device):

- ``gemms(spec, T, t)``: the forward's GEMMs (m, n, k) per device, input projections to output
  projection. Their FLOPs 2·m·n·k at t = 1 on T = b·s tokens are the block's linear FLOPs; the backward
  runs each twice (input gradient in I, weight gradient in W), as for every linear layer.
- ``recomputed_gemms(spec, T, t)``: GEMMs the kind re-runs in the backward because it does not keep
  their outputs (nothing for multi-head attention).
- ``core_flops(spec, b)``: the attention core's forward FLOPs over the whole s × s square; its backward
  is twice that.
- ``parameters(spec)``: the block's weights (the two norms of the layer are not the block's).
- ``stored_units(spec, fp8)``: 16-bit bytes kept for the backward, in units of s·b·h, as (replicated,
  tensor-parallel) parts: the first outside the tensor-parallel region (/t only with sequence
  parallelism), the second split over t. ``fp8``: GEMM inputs kept as FP8 copies (half the bytes).
- ``ring_width(spec)``: key plus value elements per token, what a context-parallel ring passes.

Multi-head attention ("mha", with grouped-query attention through ``kv_heads`` g of size d = h/a):
GEMMs QKV T × (h + 2gd)/t × h and output T × h × h/t; core 4·b·s²·h (Q·Kᵀ and scores·V); parameters
h·(h + 2gd) + h² (+ biases (h + 2gd) + h); stored: the norm input 2 and the QKV input 2 (1 as FP8)
replicated, q 2, k and v 4gd/h and the output projection's input 2 (1 as FP8) split; ring 2gd.
Multi-head latent attention ("mla"): :mod:`pipewright.cost.mla`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from pipewright.cost.mla import DEEPSEEK_V3_MLA
from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

#: tokens × n × k of one GEMM, per device
Gemm = tuple[float, float, float]


class AttentionKind(Protocol):
    """What the cost model reads of a layer's attention block (module docstring)."""

    def gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]: ...

    def recomputed_gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]: ...

    def core_flops(self, spec: ModelSpec, b: int) -> float: ...

    def parameters(self, spec: ModelSpec) -> int: ...

    def stored_units(self, spec: ModelSpec, fp8: bool = False) -> tuple[float, float]: ...

    def ring_width(self, spec: ModelSpec) -> int: ...


def kv_width(spec: ModelSpec) -> int:
    """g·d: the width of the key (and of the value) projection of multi-head attention."""
    return spec.kv_heads * spec.head_dim


@dataclass(frozen=True)
class MultiHead:
    """Multi-head (and grouped-query) attention (module docstring)."""

    def gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
        h, kv = spec.hidden, kv_width(spec)
        return ((tokens, (h + 2 * kv) / t, h), (tokens, h, h / t))

    def recomputed_gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
        return ()

    def core_flops(self, spec: ModelSpec, b: int) -> float:
        return 4 * b * spec.seq_len * spec.seq_len * spec.hidden

    def parameters(self, spec: ModelSpec) -> int:
        h, kv = spec.hidden, kv_width(spec)
        return h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if spec.bias else 0)

    def stored_units(self, spec: ModelSpec, fp8: bool = False) -> tuple[float, float]:
        gemm_input = 1 if fp8 else 2
        return 2 + gemm_input, 2 + 4 * kv_width(spec) / spec.hidden + gemm_input

    def ring_width(self, spec: ModelSpec) -> int:
        return 2 * kv_width(spec)


#: attention kinds by the name a ModelSpec's ``attention_kind`` gives
ATTENTION_KINDS: Mapping[str, AttentionKind] = MappingProxyType({"mha": MultiHead(), "mla": DEEPSEEK_V3_MLA})


def attention_of(spec: ModelSpec) -> AttentionKind:
    """The attention kind ``spec`` names; one-line ConfigError for an unknown one."""
    try:
        return ATTENTION_KINDS[spec.attention_kind]
    except KeyError:
        raise ConfigError(
            f"unknown attention kind {spec.attention_kind!r}; choose one of: {', '.join(ATTENTION_KINDS)}"
        ) from None


def gemm_flops(gemms: tuple[Gemm, ...]) -> float:
    """FLOPs of ``gemms``: Σ 2·m·n·k."""
    return sum(2 * m * n * k for m, n, k in gemms)
