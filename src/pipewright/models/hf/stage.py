"""Pipeline stages cut from a Hugging Face causal LM by its modules (no tracing).

A stage holds (see :mod:`pipewright.models.layout`) an optional :class:`HFEmbed` (the token embedding,
``embed.tok``, plus GPT-2's learned positions), the decoder layers it runs (``layers``, keyed by global
index, each the ``transformers`` module itself) and an optional :class:`HFHead` (the final norm and the
output layer, ``head.out``). The first stage takes token ids [b, s], the others the hidden state
[b, s, h]; the last returns logits [b, s, V] (the loss is pipewright's mean token cross-entropy).

What the model's own ``forward`` computes once and hands to every layer is recomputed on every stage
from the stage's input: positions 0..s−1, the rotary (cos, sin) tables from the model's rotary module
(one per attention type for Gemma 3), and the attention mask of each layer's attention type — causal,
or causal within a sliding window (``config.layer_types``; Mistral and Phi-3: a ``sliding_window``) —
made by ``transformers.masking_utils`` as the model makes it. Gemma 2/3's final-logit soft-capping
c·tanh(z/c) is applied in the head.

Parameter names are those of pipewright's stages (``embed.tok.weight``, ``layers.3.self_attn.q_proj.weight``,
``head.norm.weight``, ``head.out.weight``); :func:`hf_parameter_name` maps them to the model's own.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from pipewright.models.blocks import StageModule
from pipewright.models.hf import router_loss

SLIDING = "sliding_attention"
#: the router logits a stage's forward collects, by stage, on this thread only: a recomputation in
#: backward (or another thread's forward of the same stage, under pair overlap) adds nothing to them
_THREAD = threading.local()


def _collecting() -> dict[int, list[torch.Tensor]]:
    if not hasattr(_THREAD, "lists"):
        _THREAD.lists = {}
    return _THREAD.lists


FULL = "full_attention"


class HFEmbed(nn.Module):
    """Token embedding (``tok``; Gemma's scaling inside it, or ``scale`` when the table was rebuilt by a
    tensor-parallel factory) plus, for GPT-2, the learned position embedding ``pos``."""

    def __init__(self, tok: nn.Module, pos: nn.Module | None, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.tok = tok
        self.pos = pos
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device)).unsqueeze(0)
        return x


class HFHead(nn.Module):
    """Final norm and output layer; Gemma 2/3's soft-capping c·tanh(z/c) of the logits when c is set."""

    def __init__(self, norm: nn.Module, out: nn.Module, softcap: float | None) -> None:
        super().__init__()
        self.norm = norm
        self.out = out
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.norm(x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HFStage(StageModule):
    """One stage of a Hugging Face decoder: ``embed`` / ``layers`` / ``head`` as pipewright's stages, and
    the per-stage positions, rotary tables and masks the layers take as keyword arguments."""

    def __init__(
        self,
        config,  # transformers.PretrainedConfig
        embed: HFEmbed | None,
        layers: dict[int, nn.Module],
        head: HFHead | None,
        rotary: nn.Module | None,
        rotary_per_type: bool,
        router: router_loss.RouterLoss | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.head = head
        self.rotary = rotary
        self.rotary_per_type = rotary_per_type
        self.types = {str(i): layer_type(config, i) for i in layers}
        # the router loss's carry (models/hf/router_loss.py): hooks collect this stage's router logits
        self.router = router
        self.extra = router_loss.rows(router.experts, config.hidden_size) if router else 0
        if router is not None:
            for layer in self.layers.values():
                for module in layer.modules():
                    if isinstance(module, router.router):
                        module.register_forward_hook(self._keep_router_logits)

    def _keep_router_logits(self, module: nn.Module, args, out) -> None:
        kept = _collecting().get(id(self))
        if kept is not None:
            kept.append(out[self.router.index] if isinstance(out, tuple) else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = None
        if self.router is not None:
            _collecting()[id(self)] = []
            if self.embed is None:
                x, carry = router_loss.split_carry(x, self.router, self.extra)
        if self.embed is not None:
            x = self.embed(x)
        if len(self.layers):
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            masks = {t: attention_mask(self.config, t, x, positions) for t in set(self.types.values())}
            rope = self._rotary(x, positions)
            for name, layer in self.layers.items():
                kind = self.types[name]
                kwargs = {"attention_mask": masks[kind], "position_ids": positions}
                if rope is not None:
                    kwargs["position_embeddings"] = rope[kind] if self.rotary_per_type else rope
                out = layer(x, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
        if self.head is not None:
            x = self.head(x)
        if self.router is not None:
            kept = _collecting().pop(id(self))
            sums = router_loss.stage_sums(self.router, kept, x.device)
            carry = sums if carry is None else carry + sums
            if self.head is not None:
                setattr(x, router_loss.ATTRIBUTE, router_loss.aux_loss(self.router, carry))
            else:
                x = router_loss.attach(x, carry, self.extra)
        return x

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor):
        if self.rotary is None:
            return None
        if self.rotary_per_type:
            return {t: self.rotary(x, positions, t) for t in set(self.types.values())}
        return self.rotary(x, positions)


def layer_type(config, index: int) -> str:
    """Attention type of decoder layer ``index``: ``config.layer_types[index]`` when the config lists
    them, else sliding-window when the config sets a ``sliding_window`` (Mistral, Phi-3), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return SLIDING if getattr(config, "sliding_window", None) else FULL


def attention_mask(config, kind: str, x: torch.Tensor, positions: torch.Tensor):
    """The mask the model's own forward gives layers of attention type ``kind`` (no padding, no cache)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask
    return make(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)


def hf_parameter_name(name: str, paths: dict[str, str]) -> str:
    """The ``transformers`` model's name of stage parameter ``name`` (``paths``: the adapter's module
    paths by role, :meth:`~pipewright.models.hf.adapters.Adapter.paths`)."""
    prefixes = {
        "embed.tok.": paths["embedding"],
        "embed.pos.": paths.get("position embedding", ""),
        "layers.": paths["decoder layers"],
        "head.norm.": paths["final norm"],
        "head.out.": paths["output layer"],
    }
    for ours, theirs in prefixes.items():
        if name.startswith(ours):
            return f"{theirs}.{name[len(ours) :]}"
    raise KeyError(name)
