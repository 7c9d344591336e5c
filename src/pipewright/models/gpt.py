"""A GPT-style decoder in one readable file (after nanoGPT), cut into pipeline stages.

Model: learned token + position embeddings → ``layers`` × [x + Attn(LN(x)); x + MLP(LN(x))] → LN →
output layer (untied by default: vocabulary parallelism needs the output layer apart from the
embedding). Attention is causal ``F.scaled_dot_product_attention``; the MLP is h → ffn_hidden → h with
GELU. No dropout, so a forward pass is a pure function of weights and tokens.

Stages. :func:`build_stage` allocates only the layers one stage holds (see
:mod:`pipewright.models.layout`). The first stage takes token ids ``[b, s]`` (int64); the others take the
hidden state ``[b, s, h]``; the last returns logits ``[b, s, V]`` — the loss is :func:`loss_fn`.
Parameter names are global (``embed.tok.weight``, ``layers.7.mlp.fc_in.weight``, ``head.out.weight``),
so a name means the same tensor whatever the layout, and checkpoints move between layouts.

Initialisation (GPT-2): weights N(0, 0.02²), residual output projections N(0, (0.02/√(2l))²), biases
0, LayerNorm 1/0. Each layer draws from its own ``torch.Generator`` seeded from (seed, layer name), so
one seed gives the same weights whatever the layout.

Linear layers come from ``linear_factory(in_features, out_features, *, bias, kind)`` with ``kind`` in
:data:`LINEAR_KINDS`; the default is :class:`pipewright.models.wgrad.DeferrableLinear` (a drop-in
``nn.Linear`` whose weight gradient can be deferred, for split I/W backward). A factory
whose module holds a shard (tensor parallelism) receives the full initial weight through the module's
``load_full_(weight, bias)`` method when it has one; otherwise the weight is copied in.

Tensor parallelism (``runtime/parallel/tp/``'s factory). Optional factory hooks, used when
present: ``make.embedding(V, h)`` builds the token embedding (vocabulary-parallel: rank r holds rows
[r·V/t, (r+1)·V/t), initialised from the same full-size table, under the same parameter name), called
as ``tok(ids, add)`` with the whole position embeddings to add before its reduction over tp (see
:class:`Embedding`). With sequence parallelism (Korthikanti et al., 2022) the
activations between the tensor-parallel regions — embedding output, LayerNorms, residual stream, stage
boundaries — are this rank's [b, s/t, h] chunk; the column-parallel linears all-gather the sequence,
the row-parallel ones and the embedding reduce-scatter it, so attention always sees the whole sequence.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pipewright.models.blocks import AttentionCore, StageModule, tied_output_init_
from pipewright.models.cross_entropy import cross_entropy
from pipewright.models.layout import Layout, StageLayout, resolve_stage
from pipewright.models.moe_mlp import MoE, TokenExchange
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import LinearFactory, default_linear_factory

LINEAR_KINDS = ("qkv", "attn_out", "mlp_in", "mlp_out", "output")


def layer_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, layer name) alone: the layer's init never depends on layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _init_linear(linear: nn.Module, gen: torch.Generator, in_f: int, out_f: int, std: float) -> None:
    weight = torch.randn(out_f, in_f, generator=gen) * std
    bias = torch.zeros(out_f) if getattr(linear, "bias", None) is not None else None
    with torch.no_grad():
        if hasattr(linear, "load_full_"):
            linear.load_full_(weight, bias)
            return
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv = make(spec.hidden, 3 * spec.hidden, bias=True, kind="qkv")
        self.proj = make(spec.hidden, spec.hidden, bias=True, kind="attn_out")
        self.core = AttentionCore()  # its own module: selective recomputation checkpoints it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3h/t]; under sequence parallelism x is [b, s/t, h] and qkv full-length
        b, s = qkv.shape[:2]
        heads = qkv.shape[-1] // (3 * self.head_dim)  # local heads (fewer under tensor parallelism)
        q, k, v = qkv.view(b, s, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.fc_in = make(spec.hidden, spec.ffn_hidden, bias=True, kind="mlp_in")
        self.fc_out = make(spec.ffn_hidden, spec.hidden, bias=True, kind="mlp_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + Attn(LN(x)), then x + MLP(LN(x)); the MLP is a mixture of
    experts (:class:`~pipewright.models.moe_mlp.MoE`) in the layers ``spec.is_moe_layer(index)`` names."""

    def __init__(
        self, spec: ModelSpec, make: LinearFactory, index: int = 0, exchange: TokenExchange | None = None
    ) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(spec.hidden)
        self.attn = CausalSelfAttention(spec, make)
        self.ln_mlp = nn.LayerNorm(spec.hidden)
        if spec.is_moe_layer(index):
            self.mlp = MoE(spec, lambda f: MLP(replace(spec, ffn_hidden=f), make), _init_mlp(spec), exchange)
        else:
            self.mlp = MLP(spec, make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))

    def reset_parameters(self, spec: ModelSpec, gen: torch.Generator) -> None:
        h, f = spec.hidden, spec.ffn_hidden
        residual_std = 0.02 / math.sqrt(2 * spec.layers)
        _init_linear(self.attn.qkv, gen, h, 3 * h, 0.02)
        _init_linear(self.attn.proj, gen, h, h, residual_std)
        if isinstance(self.mlp, MoE):
            self.mlp.reset_parameters(gen)
            return
        _init_linear(self.mlp.fc_in, gen, h, f, 0.02)
        _init_linear(self.mlp.fc_out, gen, f, h, residual_std)


def _init_mlp(spec: ModelSpec) -> Callable[[nn.Module, torch.Generator, int], None]:
    """Initialise one expert MLP of hidden size f as a dense layer's MLP (GPT-2's stds)."""

    def init(mlp: nn.Module, gen: torch.Generator, f: int) -> None:
        _init_linear(mlp.fc_in, gen, spec.hidden, f, 0.02)
        _init_linear(mlp.fc_out, gen, f, spec.hidden, 0.02 / math.sqrt(2 * spec.layers))

    return init


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` whose forward also takes the tensor to add (the position embeddings): the
    signature of a factory's token embedding (``make.embedding``), which adds it before its
    tensor-parallel reduction."""

    def forward(self, ids: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(ids)
        return out if add is None else out + add


class Embedding(nn.Module):
    """Token ids [b, s] → hidden [b, s, h]: token embedding + learned position embedding. With a
    factory that has ``embedding`` the token table is built by it (vocabulary-parallel under tensor
    parallelism) and adds the whole position embeddings itself, before its reduction over the
    tensor-parallel group (under sequence parallelism a reduce-scatter to this rank's part of the
    sequence), so the position table's gradient is whole and equal on every tp rank (Megatron-LM's:
    its embedding's scatter to the sequence-parallel region has an all-gather for backward) and is
    marked ``tp_grad_whole`` (not all-reduced over tp with the replicated parameters')."""

    def __init__(self, spec: ModelSpec, make: LinearFactory | None = None) -> None:
        super().__init__()
        build = getattr(make, "embedding", TokenEmbedding)
        self.tok = build(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden)
        self.pos.weight.tp_grad_whole = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids, self.pos(positions).unsqueeze(0))

    def reset_parameters(self, spec: ModelSpec, gen: torch.Generator) -> None:
        tok = torch.randn(spec.vocab, spec.hidden, generator=gen) * 0.02
        with torch.no_grad():
            if hasattr(self.tok, "load_full_"):  # a shard: keep this rank's rows of the full-size table
                self.tok.load_full_(tok)
            else:
                self.tok.weight.copy_(tok)
            self.pos.weight.copy_(torch.randn(spec.seq_len, spec.hidden, generator=gen) * 0.01)


class Head(nn.Module):
    """Final LayerNorm and output layer: hidden [b, s, h] → logits [b, s, V]."""

    def __init__(self, spec: ModelSpec, make: LinearFactory) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(spec.hidden)
        self.out = make(spec.hidden, spec.vocab, bias=False, kind="output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))

    def reset_parameters(self, spec: ModelSpec, gen: torch.Generator) -> None:
        _init_linear(self.out, gen, spec.hidden, spec.vocab, 0.02)


class GPTStage(StageModule):
    """The layers of one pipeline stage: optional embedding, transformer layers, optional head."""

    def __init__(
        self, spec: ModelSpec, stage: StageLayout, make: LinearFactory, exchange: TokenExchange | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.stage = stage
        self.embed = Embedding(spec, make) if stage.embedding else None
        self.layers = nn.ModuleDict({str(i): Block(spec, make, i, exchange) for i in stage.layers})
        self.head = Head(spec, make) if stage.head else None

    def reset_parameters(self, seed: int) -> None:
        """Initialise every layer from its own (seed, name) generator (layout-independent)."""
        if self.embed is not None:
            self.embed.reset_parameters(self.spec, layer_generator(seed, "embed"))
        for name, block in self.layers.items():
            block.reset_parameters(self.spec, layer_generator(seed, f"layers.{name}"))
        if self.head is not None:
            self.head.reset_parameters(self.spec, layer_generator(seed, "head"))


def build_stage(
    spec: ModelSpec,
    layout: Layout | str | None,
    stage_index: int,
    *,
    seed: int = 0,
    num_stages: int | None = None,
    linear_factory: LinearFactory | None = None,
    expert_parallel: TokenExchange | None = None,
) -> GPTStage:
    """Allocate and initialise only stage ``stage_index`` of ``layout`` (a Layout, a layout string,
    or None for :func:`~pipewright.models.layout.uniform_layout` over ``num_stages``).
    ``expert_parallel``: the MoE layers hold only this ep rank's experts and exchange tokens with it."""
    stage = resolve_stage(layout, spec.layers, stage_index, num_stages)
    module = GPTStage(spec, stage, linear_factory or default_linear_factory, expert_parallel)
    module.reset_parameters(seed)
    if spec.tied_embeddings and stage.head:
        if stage.embedding:
            module.head.out.weight = module.embed.tok.weight
        else:  # tied across stages: a copy starting equal, kept equal by runtime/tied.py
            tied_output_init_(module.head.out, embedding_table(spec, seed))
    return module


def embedding_table(spec: ModelSpec, seed: int) -> torch.Tensor:
    """The initial full-size token-embedding table (what :meth:`Embedding.reset_parameters` draws first)."""
    return torch.randn(spec.vocab, spec.hidden, generator=layer_generator(seed, "embed")) * 0.02


def build_full(spec: ModelSpec, seed: int = 0, *, linear_factory: LinearFactory | None = None) -> GPTStage:
    """The whole model as one stage: the single-process reference."""
    return build_stage(spec, None, 0, seed=seed, num_stages=1, linear_factory=linear_factory)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over the microbatch's tokens, in fp32 (:mod:`pipewright.models.cross_entropy`:
    the fp32 softmax kept, its gradient written in place)."""
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
