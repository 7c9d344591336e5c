"""Analytical cost of Llama-family layers (models/llama.py): FLOPs, parameters, activation memory.

Per layer and microbatch of b sequences (s, h, a heads of size d, g key/value heads, FFN f):

- forward FLOPs: q and o projections 2·2·b·s·h², k and v 2·2·b·s·h·g·d, SwiGLU's three matrices
  3·2·b·s·h·f, attention 4·b·s²·h → 4bsh² + 4bsh·gd + 6bshf + 4bs²h (GPT's 8bsh² + 4bshf + 4bs²h with
  g·d = h and 2/3 of the MLP's width);
- parameters: 2h² + 2h·g·d + 3hf + 2h (no biases; two RMSNorm gains), embedding V·h (no position
  table), final RMSNorm h and an untied output layer V·h;
- activation memory (16-bit, Korthikanti et al.'s accounting adapted): norms 2·2sbh, q/k/v input
  2sbh, q 2sbh, k and v 2·2·sbh·g·d/h, scores 2as²b (softmax; no dropout), o input 2sbh, MLP input
  2sbh, gate/up outputs 2·2sbf, SiLU output 2sbf → sbh·(12 + 4gd/h + 6f/h) + 2as²b; selective drops
  2as²b; full keeps the layer input 2sbh. Tensor parallelism divides the parts inside the parallel
  regions by t.

:class:`LlamaCost` is :class:`~pipewright.cost.transformer.TransformerCost` with these per-layer terms
(the rest — logit layer, communication, time model, recomputation's extra forward — is the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from pipewright.cost.transformer import (
    DTYPE_BYTES,
    TransformerCost,
    layer_forward_flops,
    layer_parameters,
)
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec


def llama_layer_forward_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of one Llama layer: 4bsh² + 4bsh·gd + 6bshf + 4bs²h."""
    s, h, f = spec.seq_len, spec.hidden, spec.ffn_hidden
    kv = spec.kv_heads * spec.head_dim
    return 4 * b * s * h * h + 4 * b * s * h * kv + 6 * b * s * h * f + 4 * b * s * s * h


def llama_layer_parameters(spec: ModelSpec) -> int:
    """2h² + 2h·g·d + 3hf + 2h."""
    h, f = spec.hidden, spec.ffn_hidden
    return 2 * h * h + 2 * h * spec.kv_heads * spec.head_dim + 3 * h * f + 2 * h


def llama_layer_activation_bytes(
    spec: ModelSpec, b: int, mode: str, *, element_bytes: int = 2, t: int = 1
) -> float:
    """Bytes one Llama layer keeps per microbatch (module docstring), recompute none/selective/full."""
    s, h, a, f = spec.seq_len, spec.hidden, spec.heads, spec.ffn_hidden
    sbh = s * b * h
    if mode == "full":
        return 2 * sbh * element_bytes / 2
    kv = spec.kv_heads * spec.head_dim / h
    replicated = 4 + 2  # norms and the q/k/v input (outside the tensor-parallel regions)
    parallel = 2 + 4 * kv + 2 + 6 * f / h  # q, k, v, o input, gate/up/SiLU (split over t)
    stored = sbh * (replicated + 2 + parallel / t)  # + the MLP input
    if mode == "none":
        stored += 2 * a * s * s * b / t
    return stored * element_bytes / 2


@dataclass(frozen=True, eq=False)
class LlamaCost(TransformerCost):
    """TransformerCost with Llama's per-layer FLOPs, parameters and activation memory."""

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]):
        chunk = super()._build_chunk(stage, num_stages, layers)
        spec, b, t, n = self.spec, self.microbatch, self.mesh.tp, layers[stage]
        extra = n * (llama_layer_forward_flops(spec, b) - layer_forward_flops(spec, b)) / t
        recomputed = extra if self.recompute == "full" else 0.0
        model = {k: v + extra * {F: 1, B: 2, I: 1, W: 1}[k] for k, v in chunk.model_flops.items()}
        executed = {k: v + extra * {F: 1, B: 2, I: 1, W: 1}[k] for k, v in chunk.flops.items()}
        executed[B] += recomputed
        executed[I] += recomputed
        e = DTYPE_BYTES[self.dtype]
        added_gpt = chunk.memory[F]
        outside_layers = added_gpt - n * self._gpt_layer_bytes(e)  # embedding output, logits
        added = outside_layers + n * llama_layer_activation_bytes(
            spec, b, self.recompute, element_bytes=e, t=t
        )
        w_frees = -chunk.memory[W] * (added / added_gpt if added_gpt else 1.0)  # W's share, scaled
        memory = {F: added, B: -added, W: -w_frees, I: -(added - w_frees)}
        params = chunk.params + n * (llama_layer_parameters(spec) - layer_parameters(spec)) / t
        if stage == 0:
            params -= spec.seq_len * spec.hidden  # no position table
        if stage == num_stages - 1:
            params -= spec.hidden  # RMSNorm has no bias
        return type(chunk)(
            MappingProxyType(executed),
            MappingProxyType(model),
            chunk.tp_bytes,
            chunk.traffic,
            MappingProxyType(memory),
            params,
        )

    def _gpt_layer_bytes(self, e: int) -> float:
        """The per-layer bytes the GPT formula of the parent class charged."""
        spec, b, t = self.spec, self.microbatch, self.mesh.tp
        s, h, a = spec.seq_len, spec.hidden, spec.heads
        if self.recompute == "full":
            return 2 * s * b * h * e / 2 / (t if self.sequence_parallel else 1)
        if self.sequence_parallel:
            return s * b * h * (34 + 5 * a * s / h) / t * e / 2
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * e / 2


def cost_class(spec: ModelSpec) -> type[TransformerCost]:
    """The analytical cost model for ``spec``'s family: :class:`LlamaCost` for Llama, else
    :class:`TransformerCost`."""
    return LlamaCost if spec.family == "llama" else TransformerCost
