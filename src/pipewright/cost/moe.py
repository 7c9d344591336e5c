"""Mixture-of-experts decoder layers: parameters, FLOPs, GEMM shapes, all-to-all and stored bytes.

A mixture-of-experts (MoE) layer keeps the attention block of :mod:`pipewright.cost.layer` and replaces
the MLP by a router and E experts, each an MLP of μ matrices of width f_e (Shazeer et al. 2017; Switch
Transformer, Fedus et al. 2022; Mixtral, Jiang et al. 2024). Every token is sent to its top k experts
(plus ``shared`` experts that see every token, DeepSeekMoE). Per layer and microbatch of b sequences of
length s, hidden h, tensor-parallel size t (the attention only), expert-parallel size e (the E experts
spread over e devices, E/e each) and capacity factor φ (the tokens an expert processes, relative to an
even split; 1 for dropless routing priced at its mean):

The attention block is the spec's kind (:mod:`pipewright.cost.attention_kinds`; multi-head attention
in the formulas below, DeepSeek-V3's multi-head latent attention with ``attention_kind="mla"``).

- Parameters: attention h·(h + 2gd) + h², router h·E, experts E·μ·h·f_e (+ shared·μ·h·f_e), two
  norms. *Activated* parameters (what one token uses): attention + router + (k + shared)·μ·h·f_e + norms.
  Mixtral 8×7B: 46.7 × 10⁹ total, 12.9 × 10⁹ activated (with its embedding and output layer);
  DeepSeek-V3 (MLA, 3 dense layers): 671.0 × 10⁹ and 37.6 × 10⁹ (published: 671 B and 37 B).
- Forward FLOPs: the attention block's GEMMs 2·b·s·h·(2h + 2gd) and core 4·b·s²·h (as for a dense
  layer), the router 2·b·s·h·E, the experts 2·b·s·(k·φ + shared)·μ·h·f_e. The backward is twice that,
  split as for dense layers (input gradients in I, weight gradients in W).
- Expert GEMMs per device: the T = b·s tokens of a device are dispatched to the e devices of its
  expert-parallel group; balanced, each device receives T·k·φ token-slots and each of its E/e experts
  T·k·φ·e/E of them: E/e GEMMs (T·k·φ·e/E) × (μ − 1)·f_e × h (up, and gate for swiglu) and E/e GEMMs
  (T·k·φ·e/E) × h × f_e (down).
- All-to-all: dispatch and combine each move T·k·h elements per device, (e − 1)/e of them to other
  devices; the forward runs both, the backward both again (their gradients). Time of one all-to-all of
  N bytes per device over e devices with per-device injection bandwidth B and latency α:
  (e − 1)/e · N/B + (e − 1)·α (a pairwise exchange; every device sends and receives at once).
- Stored activation bytes (16-bit, no recomputation), in units of s·b·h: the attention block's (the
  dense layer's :func:`~pipewright.cost.layer.layer_stored_units` without its MLP part), the MLP input
  (2, before dispatch), the dispatched copies 2·k·φ, the experts' outputs 2·k·φ (kept for the
  gradient of the gate product, as Megatron-LM's unpermute with probabilities keeps them) and the
  router's fp32 probabilities 4·E/h (these four / t with sequence parallelism), and the experts'
  intermediate tensors (k·φ + shared)·(6 for swiglu, 4 otherwise)·f_e/h / t (the experts
  tensor-parallel like the dense MLP, Megatron-LM's default expert tensor parallelism).

:class:`~pipewright.cost.moe_cost.MoECost` prices ``simulate``/``plan`` chunks with these terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.attention_kinds import attention_of
from pipewright.cost.layer import (
    Gemm,
    attention_flops,
    edge_parameters,
    gemm_flops,
    layer_parameters,
    layer_stored_units,
    mlp_matrices,
    norm_parameters,
)
from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec


@dataclass(frozen=True)
class MoE:
    """The expert configuration of every MoE layer: ``experts`` E, ``top_k`` k, ``expert_ffn`` f_e (0 =
    the model's FFN width), ``shared`` experts every token uses, ``capacity`` φ (module docstring)."""

    experts: int
    top_k: int = 2
    expert_ffn: int = 0
    shared: int = 0
    capacity: float = 1.0

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ConfigError(
                f"MoE needs experts ≥ 1 and 1 ≤ top-k ≤ experts "
                f"(got {self.experts} experts, top-k {self.top_k})"
            )
        if self.shared < 0 or self.expert_ffn < 0 or self.capacity <= 0:
            raise ConfigError("MoE shared experts and expert FFN must be ≥ 0 and the capacity factor > 0")

    def ffn(self, spec: ModelSpec) -> int:
        """f_e: the expert's FFN width."""
        return self.expert_ffn or spec.ffn_hidden


def _attention_parameters(spec: ModelSpec) -> int:
    return attention_of(spec).parameters(spec) + 2 * norm_parameters(spec)


def _expert_parameters(spec: ModelSpec, moe: MoE) -> int:
    h, f, mu = spec.hidden, moe.ffn(spec), mlp_matrices(spec)
    return mu * h * f + ((mu - 1) * f + h if spec.bias else 0)


def moe_layer_parameters(spec: ModelSpec, moe: MoE) -> int:
    """All parameters of one MoE layer: attention, router h·E, E + shared experts, norms."""
    router = spec.hidden * moe.experts
    return _attention_parameters(spec) + router + (moe.experts + moe.shared) * _expert_parameters(spec, moe)


def moe_activated_parameters(spec: ModelSpec, moe: MoE) -> int:
    """Parameters one token uses in one MoE layer: attention, router, k + shared experts, norms."""
    router = spec.hidden * moe.experts
    return _attention_parameters(spec) + router + (moe.top_k + moe.shared) * _expert_parameters(spec, moe)


def moe_model_parameters(spec: ModelSpec, moe: MoE, activated: bool = False) -> float:
    """The whole model's parameters, or its activated ones: layers (the first ``moe_dense_layers``
    dense, the rest MoE) + embedding + final norm and output layer (``tied_embeddings`` counts the V·h
    matrix once)."""
    per_layer = moe_activated_parameters(spec, moe) if activated else moe_layer_parameters(spec, moe)
    dense = min(spec.moe_dense_layers, spec.layers)
    layers = dense * layer_parameters(spec) + (spec.layers - dense) * per_layer
    return layers + edge_parameters(spec, 1, True, True)


def moe_layer_forward_flops(spec: ModelSpec, moe: MoE, b: int) -> float:
    """Forward FLOPs of one MoE layer (module docstring): attention GEMMs and core, router, experts."""
    s, h = spec.seq_len, spec.hidden
    tokens = b * s
    attention_gemms = gemm_flops(attention_of(spec).gemms(spec, tokens))
    router = 2 * tokens * h * moe.experts
    experts = 2 * tokens * (moe.top_k * moe.capacity + moe.shared) * mlp_matrices(spec) * h * moe.ffn(spec)
    return attention_gemms + attention_flops(spec, b) + router + experts


def expert_gemms(
    spec: ModelSpec, moe: MoE, tokens: float, ep: int = 1, t: int = 1
) -> tuple[tuple[Gemm, int], ...]:
    """The forward's expert GEMMs on one device of an expert-parallel group of ``ep`` devices, each
    expert split over ``t`` tensor-parallel devices, as ((m, n, k), count) pairs (module docstring;
    shared experts run on the device's own tokens)."""
    if ep < 1 or moe.experts % ep:
        raise ConfigError(f"expert parallelism {ep} must divide the {moe.experts} experts")
    h, f, mu = spec.hidden, moe.ffn(spec), mlp_matrices(spec)
    local = moe.experts // ep
    per_expert = tokens * moe.top_k * moe.capacity / local
    up, down = (mu - 1) * f / t, f / t
    out: list[tuple[Gemm, int]] = [((per_expert, up, h), local), ((per_expert, h, down), local)]
    if moe.shared:
        out += [((tokens, up, h), moe.shared), ((tokens, h, down), moe.shared)]
    return tuple(out)


def all_to_all_bytes(spec: ModelSpec, moe: MoE, tokens: float, element_bytes: int = 2) -> float:
    """Bytes one device sends in one all-to-all (dispatch or combine): T·k·φ·h elements."""
    return tokens * moe.top_k * moe.capacity * spec.hidden * element_bytes


def all_to_all_time(nbytes: float, ep: int, bandwidth: float, latency: float = 0.0) -> float:
    """One all-to-all of ``nbytes`` per device over ``ep`` devices: (e − 1)/e · N/B + (e − 1)·α."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    return (ep - 1) / ep * nbytes / bandwidth + (ep - 1) * latency


def moe_stored_units(
    spec: ModelSpec, moe: MoE, t: int = 1, sequence_parallel: bool = False, fp8: bool = False
) -> float:
    """Stored 16-bit bytes of one MoE layer's forward without recomputation, in units of s·b·h
    (module docstring; flash attention: no stored scores). ``fp8``: the expert GEMMs' inputs (the
    dispatched copies and the down projections' inputs) kept as FP8 copies, as the dense layer's
    GEMM inputs are (:func:`~pipewright.cost.layer.layer_stored_units`); the router's input stays
    16-bit."""
    h, f, cast = spec.hidden, moe.ffn(spec), 1 if fp8 else 0
    dense = layer_stored_units(spec, t, sequence_parallel, scores=False, fp8=fp8)
    tensors = 6 if spec.mlp == "swiglu" else 4
    mlp_parallel = (tensors - cast) * spec.ffn_hidden / h  # the dense MLP's /t part
    mlp_replicated = 2 - cast  # the dense MLP's input, outside the tensor-parallel region
    attention_only = dense - mlp_parallel / t - mlp_replicated / (t if sequence_parallel else 1)
    slots = moe.top_k * moe.capacity
    experts = (slots + moe.shared) * (tensors - cast) * f / h
    # the experts' outputs, kept 16-bit for the gate product's gradient (∂/∂probs = output · grad)
    per_token = 2 + (2 - cast) * slots + 2 * slots + 4 * moe.experts / h
    return attention_only + per_token / (t if sequence_parallel else 1) + experts / t
