"""What one decoder layer keeps for its backward, by the implementation that runs it.

A :class:`~pipewright.models.spec.ModelSpec` names its layers' implementation in
``layer_activations``: ``"megatron"`` (the default) — Megatron-style layers, pipewright's own, Megatron-LM's
and torchtitan's, priced by Korthikanti et al.'s count (:func:`pipewright.cost.layer.layer_stored_units`)
— or an entry of :data:`ACTIVATION_SETS`, the tensors a Hugging Face family's modules keep, counted from
what autograd saves (``transformers`` 5's ``modeling_llama.py``; ``tests/test_hf_layer_activations.py``
counts the saved tensors of a tiny layer). The Hugging Face adapter of the family states it
(:mod:`pipewright.models.hf.adapters`).

Bytes per token and device of one ``transformers`` Llama decoder layer (``LlamaDecoderLayer``), e bytes
per activation element, h hidden, a heads, g·d the key/value width, f the MLP's hidden size, t the
tensor-parallel size (the norms replicated, the rest split):

- each ``LlamaRMSNorm`` (two): its input cast to fp32, kept by ``pow(2)`` and the product with the
  rsqrt (4h: the copy, or the input itself in fp32 training), the rsqrt (4), the normalised tensor
  cast back to e bytes, kept by the product with the weight (e·h), and its output, the next
  projections' input (e·h): 2·(4h + 4 + 2e·h).
- attention, ``sdpa`` (the default; flash-attention kernels alike): the rotated q (e·h), the rotated k
  and v at their own g heads (``enable_gqa``, no mask on a causal layer: 2e·gd), the output, also
  the output projection's input (e·h), the kernel's fp32 row log-sum-exp (4a) → (2e·h + 2e·gd + 4a)/t.
  The rotary products keep only the shared cos and sin tables (a stage's, not a layer's).
- attention, ``eager``: q, k and v repeated to a heads (3e·h), the fp32 softmax (4a·s), its cast to
  e bytes (e·a·s, none in fp32), the output projection's input (e·h); no dropout (p = 0).
- ``LlamaMLP`` ``down(act(gate(x)) · up(x))``: gate, act(gate), up and the product, 4e·f/t.

Llama 3 8B in bf16 with ``sdpa``: 20h + 4gd + 8f + 4a + 8 = 49.03 bytes a token and hidden unit,
where Megatron's layer keeps 34 (it recomputes the norm's fp32 part and SiLU in the backward).
Selective recomputation checkpoints no module of a ``transformers`` layer (the same bytes); full
recomputation keeps the layer's input, as for every implementation.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

MEGATRON = "megatron"
FP32 = 4


def _hf_llama_norms(spec: ModelSpec, e: float) -> float:
    """Two ``LlamaRMSNorm``: 2·(4h + 4 + 2e·h) bytes a token."""
    return 2 * (FP32 * spec.hidden + FP32 + 2 * e * spec.hidden)


def _hf_llama_mlp(spec: ModelSpec, e: float, t: int) -> float:
    """``LlamaMLP``: gate, act(gate), up and their product, 4e·f/t bytes a token."""
    return 4 * e * spec.ffn_hidden / t


def hf_llama_sdpa(spec: ModelSpec, e: float, t: int) -> float:
    """Bytes a token of a ``transformers`` Llama layer with ``sdpa`` attention (module docstring)."""
    h, gd, a = spec.hidden, spec.kv_heads * spec.head_dim, spec.heads
    attention = (2 * e * h + 2 * e * gd + FP32 * a) / t
    return _hf_llama_norms(spec, e) + attention + _hf_llama_mlp(spec, e, t)


def hf_llama_eager(spec: ModelSpec, e: float, t: int) -> float:
    """Bytes a token of a ``transformers`` Llama layer with ``eager`` attention (module docstring)."""
    h, scores = spec.hidden, spec.heads * spec.seq_len
    cast = e * scores if e < FP32 else 0.0
    attention = (4 * e * h + FP32 * scores + cast) / t
    return _hf_llama_norms(spec, e) + attention + _hf_llama_mlp(spec, e, t)


@dataclass(frozen=True)
class ActivationSet:
    """An implementation's layer: ``per_token(spec, e, t)`` bytes a token and device kept without
    recomputation; ``dropout``: whether it trains with dropout (the embedding's mask)."""

    per_token: Callable[[ModelSpec, float, int], float]
    dropout: bool = False


#: layer implementations other than Megatron's, by the name a ModelSpec's ``layer_activations`` gives
ACTIVATION_SETS: Mapping[str, ActivationSet] = MappingProxyType(
    {
        "hf-llama-sdpa": ActivationSet(hf_llama_sdpa),
        "hf-llama-eager": ActivationSet(hf_llama_eager),
    }
)


def activation_set(spec: ModelSpec) -> ActivationSet | None:
    """The set ``spec``'s layers keep; None for Megatron-style layers; one-line error for an unknown name."""
    name = spec.layer_activations
    if name == MEGATRON:
        return None
    try:
        return ACTIVATION_SETS[name]
    except KeyError:
        known = ", ".join((MEGATRON, *ACTIVATION_SETS))
        raise ConfigError(f"unknown layer activation set {name!r}; choose one of: {known}") from None


def implementation_layer_bytes(spec: ModelSpec, b: int, e: float, t: int, mode: str) -> float | None:
    """Bytes one layer of ``spec``'s implementation keeps per microbatch of b sequences and device
    under recomputation ``mode`` (none and selective alike; module docstring); None where Megatron's
    count applies (Megatron-style layers, or full recomputation: the layer's input)."""
    kept = activation_set(spec)
    if kept is None or mode == "full":
        return None
    return spec.seq_len * b * kept.per_token(spec, e, t)
