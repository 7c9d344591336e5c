"""K-FAC's per-layer formulas (Martens & Grosse 2015; PipeFisher, Osawa et al. MLSys 2023), as pure
tensor functions. Everything is computed in float32 (or float64 when given float64) whatever the
compute dtype of the activations.

For a linear layer y = W·x + b with inputs a (one row per token, with a column of ones appended when
the layer has a bias) and output gradients g (one row per token):

- curvature A = aᵀa / n,   curvature B (PipeFisher's G) = (s·g)ᵀ(s·g) / n,
  n the number of tokens, s the ``grad_scale`` that undoes the loss's mean (s = n for a loss averaged
  over n tokens, so B estimates E[∇_y ℓ ∇_y ℓᵀ] per token);
- factored Tikhonov (π-)damping: π = sqrt((tr A / dim A) / (tr B / dim B)),
  A_inv = (A + π·√λ·I)⁻¹, B_inv = (B + √λ/π·I)⁻¹, each by a Cholesky factorization;
- preconditioning of the gradient matrix [∇W, ∇b] (out × (in+1)): V = B_inv · [∇W, ∇b] · A_inv;
- KL-clipping (kfac-pytorch): ν = min(1, sqrt(κ / (lr² · Σ_layers ⟨V, ∇⟩))), every V scaled by ν.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """Factors and inverses are float32 unless the model computes in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def with_ones(a: Tensor) -> Tensor:
    """[n, d] → [n, d+1]: the column of ones that folds the bias into the weight."""
    return torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


def curvature_a(inputs: Tensor, bias: bool) -> Tensor:
    """A = aᵀa / n over every token of ``inputs`` [..., d_in] (ones column appended if ``bias``)."""
    a = inputs.detach().reshape(-1, inputs.shape[-1])
    a = a.to(factor_dtype(a.dtype))
    if bias:
        a = with_ones(a)
    return a.t() @ a / a.shape[0]


def curvature_b(grad_outputs: Tensor, grad_scale: float = 1.0) -> Tensor:
    """B = (s·g)ᵀ(s·g) / n over every token of ``grad_outputs`` [..., d_out], s = ``grad_scale``."""
    g = grad_outputs.detach().reshape(-1, grad_outputs.shape[-1])
    g = g.to(factor_dtype(g.dtype)) * grad_scale
    return g.t() @ g / g.shape[0]


def pi_damping(a: Tensor, b: Tensor) -> float:
    """π = sqrt((tr A / dim A) / (tr B / dim B)), 1 when either trace vanishes."""
    ta = float(torch.trace(a)) / a.shape[0]
    tb = float(torch.trace(b)) / b.shape[0]
    if ta <= 0 or tb <= 0 or not math.isfinite(ta / tb):
        return 1.0
    return math.sqrt(ta / tb)


def cholesky_inverse(m: Tensor, shift: float) -> Tensor:
    """(M + shift·I)⁻¹ from the Cholesky factor L of M + shift·I: L⁻ᵀL⁻¹ (torch.cholesky_inverse)."""
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    chol = torch.linalg.cholesky(m + shift * eye)
    return torch.cholesky_inverse(chol)


def grad_matrix(weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    """[∇W, ∇b] as one (out × (in+1)) matrix (or ∇W alone without a bias), in the factors' dtype."""
    dtype = factor_dtype(weight_grad.dtype)
    if bias_grad is None:
        return weight_grad.to(dtype)
    return torch.cat([weight_grad.to(dtype), bias_grad.to(dtype).unsqueeze(1)], dim=1)


def precondition(a_inv: Tensor, b_inv: Tensor, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    """V = B_inv · [∇W, ∇b] · A_inv (bias folded into A)."""
    return b_inv @ grad_matrix(weight_grad, bias_grad) @ a_inv


def kl_clip_scale(pairs: list[tuple[Tensor, Tensor]], lr: float, kl_clip: float) -> float:
    """ν = min(1, sqrt(κ / Σ lr²·⟨V, ∇⟩)) over (preconditioned, raw) gradient pairs; 1 if the sum ≤ 0."""
    if kl_clip <= 0 or not pairs:
        return 1.0
    vg = sum(float((v.double() * g.double()).sum()) for v, g in pairs) * lr * lr
    if vg <= 0 or not math.isfinite(vg):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg))


class PiecewiseInverse:
    """(M + shift·I)⁻¹ computed in pieces, each a bounded amount of work (beyond PipeFisher, whose
    inversion is one task): ``panels`` steps of a right-looking blocked Cholesky (step j factors the
    diagonal block of panel j, solves the panel below it, and updates the trailing matrix), then one
    step forming the inverse from the factor (``blocks`` = 0) or ``blocks`` steps that each solve
    L·Lᵀ·X_J = E_J for one block J of columns. :meth:`step` runs the next piece; :attr:`result` is
    the inverse once :attr:`done`."""

    def __init__(self, m: Tensor, shift: float, panels: int, blocks: int = 0) -> None:
        n = m.shape[0]
        self.work = m + shift * torch.eye(n, dtype=m.dtype, device=m.device)
        self.n, self.panels, self.blocks = n, panels, blocks
        self.bounds = [round(j * n / panels) for j in range(panels + 1)]
        self.index = 0
        self.result: Tensor | None = None
        self._cols: list[Tensor] = []

    @property
    def count(self) -> int:
        return self.panels + max(self.blocks, 1)

    @property
    def done(self) -> bool:
        return self.index >= self.count

    def step(self) -> None:
        j = self.index
        if j < self.panels:
            lo, hi = self.bounds[j], self.bounds[j + 1]
            a = self.work
            diag = torch.linalg.cholesky(a[lo:hi, lo:hi])
            a[lo:hi, lo:hi] = diag
            if hi < self.n:
                below = torch.linalg.solve_triangular(diag, a[hi:, lo:hi].t(), upper=False).t()
                a[hi:, lo:hi] = below
                a[hi:, hi:] -= below @ below.t()
        else:
            chol = torch.tril(self.work)
            if self.blocks == 0:
                self.result = torch.cholesky_inverse(chol)
            else:
                b = j - self.panels
                lo, hi = round(b * self.n / self.blocks), round((b + 1) * self.n / self.blocks)
                eye = torch.eye(self.n, dtype=chol.dtype, device=chol.device)[:, lo:hi]
                self._cols.append(torch.cholesky_solve(eye, chol))
                if b == self.blocks - 1:
                    self.result = torch.cat(self._cols, dim=1)
        self.index += 1
