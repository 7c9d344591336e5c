"""Llama-family layers (models/llama.py) in the analytical cost model.

Per layer and microbatch of b sequences (s, h, a heads of size d, g key/value heads, FFN f), as
:mod:`pipewright.cost.layer` computes them for ``mlp="swiglu"`` without biases:

- forward FLOPs: q and o projections 2·2·b·s·h², k and v 2·2·b·s·h·g·d, SwiGLU's three matrices
  3·2·b·s·h·f, attention 4·b·s²·h → 4bsh² + 4bsh·gd + 6bshf + 4bs²h;
- parameters: 2h² + 2h·g·d + 3hf + 2h (no biases; two RMSNorm gains), embedding V·h (no position
  table), final RMSNorm h and an output layer V·h (a tied one shares the embedding's table where one
  stage holds both: :func:`pipewright.cost.layer.edge_parameters`);
- activation memory (16-bit): norms 2·2sbh, q/k/v input 2sbh, MLP input 2sbh outside the
  tensor-parallel regions (/t too with sequence parallelism); q 2sbh, k and v 2·2·sbh·g·d/h, o input
  2sbh, gate/up outputs and the SiLU product's input 3·2sbf inside them (/t); eager scores 2as²b/t
  (no dropout) → sbh·(8 + (4 + 4gd/h + 6f/h)/t) + 2as²b/t; flash attention and selective
  recomputation drop the scores; full keeps the layer input 2sbh.

:class:`LlamaCost` is :class:`~pipewright.cost.transformer.TransformerCost`, which reads the family's
terms from the spec (``mlp``, ``bias``, ``kv_heads``); the name stays for callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.transformer import TransformerCost
from pipewright.models.spec import ModelSpec


@dataclass(frozen=True, eq=False)
class LlamaCost(TransformerCost):
    """TransformerCost of a Llama-family spec (the per-layer terms come from the spec)."""


def cost_class(spec: ModelSpec) -> type[TransformerCost]:
    """The analytical cost model for ``spec``'s family: :class:`LlamaCost` for Llama, else
    :class:`TransformerCost`; :class:`~pipewright.cost.moe_cost.MoECost` for a mixture of experts;
    with multi-token prediction, that class with :mod:`pipewright.cost.mtp`'s modules."""
    cls: type[TransformerCost] = LlamaCost if spec.family == "llama" else TransformerCost
    if spec.is_moe:
        from pipewright.cost.moe_cost import MoECost

        cls = MoECost
    if spec.mtp_depth:
        from pipewright.cost.mtp import with_mtp

        cls = with_mtp(cls)
    return cls
