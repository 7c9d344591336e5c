"""Ring attention's block computation tiled over the keys (runtime/parallel/cp/ring.py): with tiles smaller
than a block the ring still equals full causal attention, and no fp32 tensor as large as a whole
block's scores [b, heads, n, m] is ever made — the largest is one tile's, n × KEY_TILE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pipewright.runtime.parallel.cp import ring
from pipewright.runtime.parallel.cp.ring import block_backward, block_forward

B, HEADS, D = 2, 2, 8


class _LargestFp32(TorchDispatchMode):
    """The largest float32 tensor any operation returns while active (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("tile", [3, 4, 64])
def test_tiled_block_equals_full_causal_attention(monkeypatch, tile: int) -> None:
    monkeypatch.setattr(ring, "KEY_TILE", tile)
    gen = torch.Generator().manual_seed(tile)
    n = 10
    q, k, v, g = (torch.randn(B, HEADS, n, D, generator=gen, dtype=torch.float64) for _ in range(4))
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    want.backward(g)
    q32, k32, v32, g32 = (t.float() for t in (q, k, v, g))
    scale = D**-0.5
    out, lse = block_forward(q32, k32, v32, True, scale)
    delta = (g32 * out).sum(-1)
    dq, dk, dv = block_backward(q32, k32, v32, g32, delta, lse, True, scale)
    for name, got, ref in (("out", out, want), ("dq", dq, qf.grad), ("dk", dk, kf.grad), ("dv", dv, vf.grad)):
        torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_block_holds_no_fp32_score_block(monkeypatch) -> None:
    monkeypatch.setattr(ring, "KEY_TILE", 16)
    n, m = 64, 128  # an off-diagonal block: every query against every key
    gen = torch.Generator().manual_seed(0)
    q, d_out = (torch.randn(B, HEADS, n, D, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, HEADS, m, D, generator=gen).bfloat16() for _ in range(2))
    with _LargestFp32() as seen:
        out, lse = block_forward(q, k, v, False, D**-0.5)
        block_backward(q, k, v, d_out, (d_out.float() * out).sum(-1), lse, False, D**-0.5)
    tile, block, keys = B * HEADS * n * 16, B * HEADS * n * m, B * HEADS * m * D
    assert seen.largest <= max(tile, keys) < block
