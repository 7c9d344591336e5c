"""What the model blocks keep for backward (Megatron's accounting, Korthikanti et al. 2022): RMSNorm its
input and gain, SwiGLU its gate and up outputs, grouped-query attention k and v at kv_heads — with
gradients equal bit for bit to the blocks' plain autograd graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipewright.models import blocks
from pipewright.models.blocks import AttentionCore, RMSNorm, recomputed_in_backward


def _kept(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    shapes: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        out = fn(*inputs)
    return out, shapes


def _grads(out: torch.Tensor, grad: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_its_input_and_gain_with_the_same_gradients(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(16).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    x = torch.randn(2, 5, 16, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(2, 5, 16, generator=gen).to(dtype)
    out, kept = _kept(norm, x)
    assert sorted(kept) == sorted([(2, 5, 16), (16,)])
    got = _grads(out, g, x, norm.weight)
    want = _grads(_plain_rms_norm(x, norm.weight, norm.eps), g, x, norm.weight)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_keeps_gate_and_up_with_the_same_gradients(dtype):
    gen = torch.Generator().manual_seed(1)
    gate, up, g = (torch.randn(3, 7, generator=gen).to(dtype) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()
    out, kept = _kept(recomputed_in_backward, _swiglu, gate, up)
    assert kept == [(3, 7), (3, 7)]
    got = _grads(out, g, gate, up)
    want = _grads(_swiglu(gate, up), g, gate, up)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(not blocks._SDPA_GQA, reason="torch < 2.5 has no enable_gqa: k and v are repeated")
def test_grouped_query_attention_keeps_k_and_v_at_kv_heads():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 16, generator=gen, requires_grad=True) for _ in range(2))
    out, kept = _kept(AttentionCore(), q, k, v)
    # q and the output at 4 heads, the log-sum-exp; k and v at 2 heads, not repeated to the query heads
    assert sorted(kept) == sorted([(1, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8), (1, 2, 8, 16), (1, 2, 8, 16)])
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
