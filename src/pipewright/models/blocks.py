"""Building blocks shared by the model files (GPT, Llama): the attention core, RMSNorm, rotary
position embeddings, and the initialisation of a tied output layer.

The attention core is its own (parameter-free) module so that the runtime can recompute exactly it —
selective activation recomputation (Korthikanti et al., 2022, §5) checkpoints the softmax(QKᵀ)V part of
attention, whose stored activations grow with s², and keeps everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class AttentionCore(nn.Module):
    """Causal softmax(QKᵀ/√d)V over [b, heads, s, d] queries and [b, kv_heads, s, d] keys/values.

    Grouped-query attention (Ainslie et al., 2023): with fewer key/value heads than query heads, query
    head j uses key/value head ⌊j / (heads / kv_heads)⌋ (each kv head repeated, as Llama does). The
    kernel reads the shared heads itself (``enable_gqa``, torch ≥ 2.5), so backward keeps k and v at
    kv_heads, as a fused attention kernel does; older torch repeats them."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1 and _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class _RecomputedInBackward(torch.autograd.Function):
    """y = fn(*inputs), keeping only ``inputs`` for backward: the backward runs ``fn`` again on them and
    differentiates that, so the gradients are those of ``fn``'s own autograd graph, op for op, while
    the intermediates of ``fn`` (cheap elementwise ones) are not held between forward and backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need, strict=True)]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        wanted = [t for t, n in zip(inputs, need, strict=True) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return None, *(next(grads) if n else None for n in need)


def recomputed_in_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` holding only ``inputs`` for backward (see :class:`_RecomputedInBackward`); plain
    ``fn(*inputs)`` under ``torch.compile``, whose partitioner chooses what to keep itself."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return fn(*inputs)
    return _RecomputedInBackward.apply(fn, *inputs)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + ε) · g (Zhang & Sennrich, 2019), computed in float32 and cast back, as
    Llama does; g starts at 1. Backward keeps x (in its own dtype) and g only, recomputing the float32
    part — Megatron's accounting of a norm's stored activations (its input, 2sbh bytes in 16 bits)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed_in_backward(partial(_rms_norm, eps=self.eps), x, self.weight)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, d] of rotary position embeddings (Su et al., RoFormer): angle p·θ^(−2i/d) for
    position p and frequency i < d/2, repeated over the two halves of the head (the "rotate half"
    layout of Hugging Face's Llama, so its checkpoints load without permuting q/k rows)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, s, d] by the position angles: x·cos + rotate_half(x)·sin, with
    rotate_half([x₁, x₂]) = [−x₂, x₁]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def tied_output_init_(out: nn.Module, table: torch.Tensor) -> None:
    """Initialise an output layer [V, h] with the embedding table it is tied to (full size; a
    tensor-parallel shard keeps its rows through ``load_full_``)."""
    with torch.no_grad():
        if hasattr(out, "load_full_"):
            out.load_full_(table)
        else:
            out.weight.copy_(table)


class StageModule(nn.Module):
    """One pipeline stage of a decoder-only model: its optional embedding (``embed``), its transformer
    layers (``layers``, keyed by global index) and its optional head (``head``), applied in order."""

    embed: nn.Module | None
    layers: nn.ModuleDict
    head: nn.Module | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x
