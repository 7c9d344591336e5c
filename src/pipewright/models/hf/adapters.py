"""Where a Hugging Face causal LM keeps the modules a pipeline stage is cut from, per ``model_type``.

A decoder family fits pipewright's stage cut when its ``*ForCausalLM`` holds, under one base module,
a token embedding, a list of decoder layers, a final norm and (beside the base) an output layer, with
rotary position embeddings (if any) in a module of the base that every stage can call. One
:class:`Adapter` per family names those modules; a family not in :data:`ADAPTERS` is tried with the
Llama layout (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``,
``model.rotary_emb``), and a module that is missing is named in a one-line error.

``tp_kinds``: for tensor parallelism (Megatron's split, Shoeybi et al., 2019), the linear layers of a
decoder layer by attribute name → the kind of pipewright's linear factory ("mlp_in": column-parallel,
"attn_out" / "mlp_out": row-parallel). A family whose projections are fused (Phi-3's ``qkv_proj``
and ``gate_up_proj``, GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``) has no entry there and
tensor parallelism stops with the name of the fused module.

``activations``: what the family's decoder layer keeps for its backward, by attention implementation
(``config._attn_implementation``; ``sdpa`` when the config names none) → the set of
:mod:`pipewright.cost.layer_activations` the cost model prices it with, stated in the model's
:class:`~pipewright.models.spec.ModelSpec` (``layer_activations``). Llama's ``transformers`` modules keep
their RMSNorms' fp32 inputs and the MLP's SiLU output, which Megatron's layer recomputes; a family or
attention implementation not listed is priced as Megatron's layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from pipewright.errors import ConfigError

#: Llama-style projections: q/k/v and gate/up column-parallel, o and down row-parallel
LLAMA_TP: Mapping[str, str] = MappingProxyType(
    {
        "q_proj": "mlp_in",
        "k_proj": "mlp_in",
        "v_proj": "mlp_in",
        "o_proj": "attn_out",
        "gate_proj": "mlp_in",
        "up_proj": "mlp_in",
        "down_proj": "mlp_out",
    }
)


@dataclass(frozen=True)
class Adapter:
    """Module paths of one family, relative to the ``*ForCausalLM`` model."""

    base: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"
    head: str = "lm_head"
    positions: str | None = None  # a learned position embedding in the base (GPT-2's wpe)
    rotary: str | None = "rotary_emb"
    rotary_per_type: bool = False  # one rotary table per attention type (Gemma 3: local and global)
    tp_kinds: Mapping[str, str] = field(default_factory=dict)
    tp_blocker: str = "no tensor-parallel split is known for this family"  # why, when tp_kinds is empty
    activations: Mapping[str, str] = field(default_factory=dict)  # attention implementation → set

    def layer_activations(self, attention: str | None) -> str:
        """The cost model's activation set for the layers under ``attention`` (module docstring)."""
        return self.activations.get(attention or "sdpa", "megatron")

    def paths(self) -> dict[str, str]:
        """The dotted path of every module the stages use, by role."""
        out = {
            "embedding": f"{self.base}.{self.embed}",
            "decoder layers": f"{self.base}.{self.layers}",
            "final norm": f"{self.base}.{self.norm}",
            "output layer": self.head,
        }
        if self.positions:
            out["position embedding"] = f"{self.base}.{self.positions}"
        if self.rotary:
            out["rotary embedding"] = f"{self.base}.{self.rotary}"
        return out


_LLAMA = Adapter(tp_kinds=LLAMA_TP)
#: what transformers' LlamaDecoderLayer keeps (cost/layer_activations.py counts it)
LLAMA_ACTIVATIONS: Mapping[str, str] = MappingProxyType({"sdpa": "hf-llama-sdpa", "eager": "hf-llama-eager"})

ADAPTERS: Mapping[str, Adapter] = MappingProxyType(
    {
        "llama": Adapter(tp_kinds=LLAMA_TP, activations=LLAMA_ACTIVATIONS),
        "mistral": _LLAMA,
        "qwen2": _LLAMA,
        "qwen3": _LLAMA,
        "gemma": _LLAMA,
        "gemma2": _LLAMA,
        "gemma3_text": Adapter(rotary_per_type=True, tp_kinds=LLAMA_TP),
        "olmo": _LLAMA,
        "olmo2": Adapter(tp_blocker="self_attn.q_norm normalises all heads together"),
        "phi3": Adapter(tp_blocker="self_attn.qkv_proj and mlp.gate_up_proj are fused projections"),
        # mixtures of experts: the experts' weights are fused parameters (transformers' *Experts modules)
        "mixtral": Adapter(tp_blocker="mlp.experts holds every expert's weights in one fused parameter"),
        "qwen2_moe": Adapter(tp_blocker="mlp.experts holds every expert's weights in one fused parameter"),
        "gpt2": Adapter(
            base="transformer",
            embed="wte",
            layers="h",
            norm="ln_f",
            positions="wpe",
            rotary=None,
            tp_blocker="attn.c_attn is a fused q/k/v Conv1D",
        ),
        "gpt_neox": Adapter(
            base="gpt_neox",
            embed="embed_in",
            norm="final_layer_norm",
            tp_blocker="attention.query_key_value is a fused q/k/v projection",
        ),
    }
)


def adapter_for(model_type: str) -> Adapter:
    """The family's adapter; the Llama layout for a family not in the table (checked by :func:`modules`)."""
    return ADAPTERS.get(model_type, Adapter())


def submodule(model: nn.Module, path: str, model_type: str, role: str) -> nn.Module:
    """``model``'s module at dotted ``path``; a one-line ConfigError naming it when it is missing."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} cannot be cut into pipeline stages: no {role} "
            f"module {path!r} (expected embedding, decoder layers, final norm and output layer)"
        ) from None


def modules(model: nn.Module, model_type: str) -> dict[str, nn.Module]:
    """Every module the stages use, by role, each checked (one-line error naming a missing one)."""
    adapter = adapter_for(model_type)
    found = {role: submodule(model, path, model_type, role) for role, path in adapter.paths().items()}
    if not isinstance(found["decoder layers"], nn.ModuleList):
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} cannot be cut into pipeline stages: "
            f"{adapter.paths()['decoder layers']!r} is not a list of decoder layers"
        )
    return found
