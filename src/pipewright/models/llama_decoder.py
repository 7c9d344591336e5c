"""A Llama-family decoder (Touvron et al. 2023; Llama 3, Dubey et al. 2024) in one readable file, cut
into pipeline stages like :mod:`pipewright.models.gpt`.

Model: token embedding (no position table) → ``layers`` × [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))]
→ RMSNorm → output layer. No biases anywhere.

- Attention: q = x·W_qᵀ ([b, s, a·d]), k, v = x·W_kᵀ, x·W_vᵀ ([b, s, g·d], g = ``kv_heads`` ≤ a:
  grouped-query attention, Ainslie et al. 2023); rotary position embeddings (θ = ``rope_theta``,
  the "rotate half" layout) on q and k; causal softmax(qkᵀ/√d)v with each kv head serving a/g query
  heads; output projection W_o.
- MLP (SwiGLU, Shazeer 2020): W_down(silu(x·W_gateᵀ) ⊙ x·W_upᵀ), hidden size ``ffn_hidden``.
- RMSNorm (ε = 1e-5) with a learned gain.

Parameter names follow GPT's scheme (``embed.tok.weight``, ``layers.3.attn.q.weight``,
``layers.3.mlp.gate.weight``, ``head.norm.weight``, ``head.out.weight``) and are global, so checkpoints
move between layouts; :mod:`pipewright.models.hf_load` maps Hugging Face's names onto them.

Tensor parallelism through the same ``linear_factory(in, out, *, bias, kind)`` as GPT: q, k, v, gate and
up are column-parallel (kind ``mlp_in``: one block, output features split), o and down row-parallel
(``attn_out``, ``mlp_out``), the output layer column-parallel over the vocabulary (``output``), the
embedding vocabulary-parallel when the factory has ``embedding``. Rank r then holds query heads
[r·a/t, (r+1)·a/t) and kv heads [r·g/t, (r+1)·g/t) — exactly the kv heads its query heads use, so t
must divide g. Under sequence parallelism the column-parallel layers all-gather the sequence before
attention, so rotary embeddings always see whole sequences. q, k, v (and gate, up) stay separate layers
(their parameter names are global) but share one input (:func:`~pipewright.models.wgrad.shared_input`):
one gather in the forward, one in the backward and one reduce-scatter (or all-reduce) of the summed
input gradients a group, as Megatron's fused QKV and gate/up linears.

Initialisation: linear weights N(0, 0.02²), the residual projections (o, down) N(0, (0.02/√(2l))²),
embedding N(0, 0.02²), RMSNorm gains 1; one generator per layer seeded from (seed, name), as GPT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.blocks import (
    AttentionCore,
    RMSNorm,
    StageModule,
    apply_rope,
    recomputed_in_backward,
    rope_tables,
    tied_output_init_,
)
from pipewright.models.gpt import _init_linear, layer_generator
from pipewright.models.layout import Layout, StageLayout, resolve_stage
from pipewright.models.moe_mlp import MoE, TokenExchange
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import LinearFactory, default_linear_factory, shared_input

NORM_EPS = 1e-5
COLUMN, ROW = "mlp_in", "mlp_out"  # factory kinds of a plain column- / row-parallel linear


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        h, d, g = spec.hidden, spec.head_dim, spec.kv_heads
        self.head_dim = d
        self.q = make(h, h, bias=False, kind=COLUMN)
        self.k = make(h, g * d, bias=False, kind=COLUMN)
        self.v = make(h, g * d, bias=False, kind=COLUMN)
        self.o = make(h, h, bias=False, kind="attn_out")
        self.core = AttentionCore()  # its own module: selective recomputation checkpoints it
        cos, sin = rope_tables(spec.seq_len, d, spec.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s = t.shape[:2]
        return t.view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, local heads, s, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = shared_input(x, self.q, self.k, self.v)  # one gather for the three (Megatron's fused QKV)
        q, k, v = self._heads(self.q(xs)), self._heads(self.k(xs)), self._heads(self.v(xs))
        del xs  # the gathered input is not kept through attention (the linears keep x, the chunk)
        s = q.shape[2]
        cos, sin = self.cos[:s], self.sin[:s]
        y = self.core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        b = y.shape[0]
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.gate = make(spec.hidden, spec.ffn_hidden, bias=False, kind=COLUMN)
        self.up = make(spec.hidden, spec.ffn_hidden, bias=False, kind=COLUMN)
        self.down = make(spec.ffn_hidden, spec.hidden, bias=False, kind=ROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate)·up recomputed in backward: kept are gate, up (and down's input), as a fused SwiGLU
        xs = shared_input(x, self.gate, self.up)  # one gather for both (Megatron's fused gate/up)
        gate, up = self.gate(xs), self.up(xs)
        del xs  # not kept through down (the linears keep x, the chunk)
        return self.down(recomputed_in_backward(_swiglu, gate, up))


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class LlamaBlock(nn.Module):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); SwiGLU experts
    (:class:`~pipewright.models.moe_mlp.MoE`) in the layers ``spec.is_moe_layer(index)`` names."""

    def __init__(
        self, spec: ModelSpec, make: LinearFactory, index: int = 0, exchange: TokenExchange | None = None
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, NORM_EPS)
        self.attn = LlamaAttention(spec, make)
        self.mlp_norm = RMSNorm(spec.hidden, NORM_EPS)
        if spec.is_moe_layer(index):
            self.mlp = MoE(
                spec, lambda f: SwiGLU(replace(spec, ffn_hidden=f), make), _init_swiglu(spec), exchange
            )
        else:
            self.mlp = SwiGLU(spec, make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def reset_parameters(self, spec: ModelSpec, gen: torch.Generator) -> None:
        h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_heads * spec.head_dim
        residual_std = 0.02 / math.sqrt(2 * spec.layers)
        for layer, i, o, std in (
            (self.attn.q, h, h, 0.02),
            (self.attn.k, h, kv, 0.02),
            (self.attn.v, h, kv, 0.02),
            (self.attn.o, h, h, residual_std),
        ):
            _init_linear(layer, gen, i, o, std)
        if isinstance(self.mlp, MoE):
            self.mlp.reset_parameters(gen)
        else:
            _init_swiglu(spec)(self.mlp, gen, f)


def _init_swiglu(spec: ModelSpec) -> Callable[[nn.Module, torch.Generator, int], None]:
    """Initialise a SwiGLU of hidden size f: gate, up N(0, 0.02²), down N(0, (0.02/√(2l))²)."""

    def init(mlp: nn.Module, gen: torch.Generator, f: int) -> None:
        h, residual_std = spec.hidden, 0.02 / math.sqrt(2 * spec.layers)
        _init_linear(mlp.gate, gen, h, f, 0.02)
        _init_linear(mlp.up, gen, h, f, 0.02)
        _init_linear(mlp.down, gen, f, h, residual_std)

    return init


class LlamaEmbedding(nn.Module):
    """Token ids [b, s] → [b, s, h] (vocabulary-parallel when the factory builds it)."""

    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.tok = getattr(make, "embedding", nn.Embedding)(spec.vocab, spec.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)

    def reset_parameters(self, spec: ModelSpec, gen: torch.Generator) -> None:
        tied_output_init_(self.tok, embedding_table(spec, gen))


def embedding_table(spec: ModelSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(spec.vocab, spec.hidden, generator=gen) * 0.02


class LlamaHead(nn.Module):
    """Final RMSNorm and output layer: [b, s, h] → logits [b, s, V]."""

    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden, NORM_EPS)
        self.out = make(spec.hidden, spec.vocab, bias=False, kind="output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class LlamaStage(StageModule):
    """The layers of one pipeline stage: optional embedding, Llama layers, optional head."""

    def __init__(
        self, spec: ModelSpec, stage: StageLayout, make: LinearFactory, exchange: TokenExchange | None = None
    ) -> None:
        super().__init__()
        self.spec, self.stage = spec, stage
        self.embed = LlamaEmbedding(spec, make) if stage.embedding else None
        self.layers = nn.ModuleDict({str(i): LlamaBlock(spec, make, i, exchange) for i in stage.layers})
        self.head = LlamaHead(spec, make) if stage.head else None

    def reset_parameters(self, seed: int) -> None:
        spec = self.spec
        if self.embed is not None:
            self.embed.reset_parameters(spec, layer_generator(seed, "embed"))
        for name, block in self.layers.items():
            block.reset_parameters(spec, layer_generator(seed, f"layers.{name}"))
        if self.head is not None:
            if spec.tied_embeddings:  # the embedding's table (tied on one stage below, or a kept-equal copy)
                tied_output_init_(self.head.out, embedding_table(spec, layer_generator(seed, "embed")))
            else:
                _init_linear(self.head.out, layer_generator(seed, "head"), spec.hidden, spec.vocab, 0.02)


def build_stage(
    spec: ModelSpec,
    layout: Layout | str | None,
    stage_index: int,
    *,
    seed: int = 0,
    num_stages: int | None = None,
    linear_factory: LinearFactory | None = None,
    expert_parallel: TokenExchange | None = None,
) -> LlamaStage:
    """Allocate and initialise only stage ``stage_index`` of ``layout`` (as GPT's ``build_stage``)."""
    if spec.heads % spec.kv_heads:
        raise ConfigError(f"--heads {spec.heads} is not divisible by --kv-heads {spec.kv_heads}")
    if spec.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head size (hidden/heads = {spec.head_dim})")
    stage = resolve_stage(layout, spec.layers, stage_index, num_stages)
    module = LlamaStage(spec, stage, linear_factory or default_linear_factory, expert_parallel)
    module.reset_parameters(seed)
    if spec.tied_embeddings and stage.embedding and stage.head:
        module.head.out.weight = module.embed.tok.weight
    return module
