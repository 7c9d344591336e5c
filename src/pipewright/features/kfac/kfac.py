"""K-FAC state and tasks for a rank's linear layers, one task per (layer, microbatch) or per layer.

The tasks are the units PipeFisher places into pipeline bubbles (Osawa et al., MLSys 2023):

- ``curvature_a(i, k)``: A of layer i from microbatch k's saved inputs (after its F);
- ``curvature_b(i, k)``: B from microbatch k's saved output gradients (after its B or I);
- ``reduce_factors(i)``: mean over the refresh's microbatches, all-reduce (mean) over the data-parallel
  group, then the running average A ← ρ·A + (1 − ρ)·A_new (the first refresh takes A_new);
- ``invert(i, which)``: (A + π√λ I)⁻¹ or (B + √λ/π I)⁻¹ by Cholesky (π fixed at reduction time);
- ``precondition(i)``: V = B⁻¹ [∇W, ∇b] A⁻¹ from the latest inverses, kept until :meth:`KFAC.apply`
  KL-clips every V and writes it into the parameters' ``.grad``.

Accumulators of a refresh are separate from the running factors, so a new refresh's curvature can start
while the previous one is being inverted. Tensor parallelism: a column-parallel layer sees the full input
and its shard of the output gradient, so its A is the full A and its B the diagonal block of the full B
for its output rows; a row-parallel layer sees its input shard (A = the diagonal block for its input
columns, no ones column: its bias is added after the reduction and stays first-order) and the full
output gradient (B = the full B). K-FAC then ignores the off-diagonal blocks between shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipewright.errors import ConfigError
from pipewright.features.kfac import factors as fx


@dataclass(frozen=True)
class KFACConfig:
    """Options as in kfac-pytorch: damping λ, running-average decay ρ, KL-clip κ (0 disables), and the
    factor and inverse update intervals (in optimizer steps; the inverse interval is a multiple of the
    factor interval)."""

    damping: float = 1e-3
    factor_decay: float = 0.95
    kl_clip: float = 1e-3
    factor_interval: int = 1
    inv_interval: int = 10

    def __post_init__(self) -> None:
        if self.damping <= 0:
            raise ConfigError(f"K-FAC damping must be positive (got {self.damping})")
        if not 0 <= self.factor_decay < 1:
            raise ConfigError(f"K-FAC factor decay must be in [0, 1) (got {self.factor_decay})")
        if self.factor_interval < 1 or self.inv_interval < 1 or self.inv_interval % self.factor_interval:
            raise ConfigError(
                f"K-FAC intervals: inverse interval ({self.inv_interval}) must be a positive multiple of "
                f"the factor interval ({self.factor_interval})"
            )


def is_row_parallel(module: nn.Module) -> bool:
    return type(module).__name__ == "RowParallelLinear"


def is_covered(module: nn.Module) -> bool:
    """Linear layers K-FAC preconditions: ``nn.Linear`` and its subclasses, and the tensor-parallel
    column/row-parallel linears (anything with a 2-D ``weight`` and ``in_features``/``out_features``)."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, Tensor)
        and weight.ndim == 2
        and hasattr(module, "in_features")
        and hasattr(module, "out_features")
    )


def covered_layers(model: nn.Module, exclude: Iterable[str] = ("head",)) -> list[tuple[str, nn.Module]]:
    """(name, module) of every covered linear of ``model`` whose name has no part in ``exclude`` (the
    output layer stays first-order by default; embeddings and LayerNorm are never covered)."""
    skip = set(exclude)
    return [
        (name, m)
        for name, m in model.named_modules()
        if name and is_covered(m) and not skip.intersection(name.split("."))
    ]


@dataclass
class LayerState:
    """One layer's factors: this refresh's sums, the running factors, their inverses, saved tensors."""

    name: str
    module: nn.Module
    bias: bool  # the ones column is part of A
    a_sum: Tensor | None = None
    b_sum: Tensor | None = None
    a_count: int = 0
    b_count: int = 0
    a: Tensor | None = None
    b: Tensor | None = None
    pi: float = 1.0
    a_inv: Tensor | None = None
    b_inv: Tensor | None = None
    saved_inputs: dict[int, Tensor] = field(default_factory=dict)
    saved_grads: dict[int, Tensor] = field(default_factory=dict)
    saved_scales: dict[int, float] = field(default_factory=dict)  # fp16: the loss scale S of a saved gradient
    preconditioned: Tensor | None = None
    grad_norm: float = 0.0  # ‖[∇W, ∇b]‖ when preconditioned (to follow a later clipping)


class KFAC:
    """K-FAC over ``layers`` [(name, module)]: hooks save inputs and output gradients per microbatch
    while :attr:`microbatch` is set; the task methods turn them into factors, inverses and
    preconditioned gradients. ``grad_scale`` is s in B = (s·g)ᵀ(s·g)/n (see :mod:`.factors`).
    ``dp_group``: the data-parallel group the factors are averaged over (None: no reduction).
    ``loss_scale`` (fp16): returns the loss scale S in effect; a saved output gradient is S·g and its
    B uses s/S. Captured tensors stay in the compute dtype (half the memory) and are upcast to fp32
    before any arithmetic (:mod:`.factors`); factors and inverses are fp32."""

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        config: KFACConfig | None = None,
        *,
        grad_scale: float = 1.0,
        dp_group: object | None = None,
        loss_scale: Callable[[], float] | None = None,
    ) -> None:
        self.config = config or KFACConfig()
        self.loss_scale = loss_scale
        self.masters: dict[int, Tensor] = {}  # id(model parameter) → the fp32 master the optimizer steps
        self.grad_scale = grad_scale
        self.dp_group = dp_group
        self.layers = [
            LayerState(n, m, getattr(m, "bias", None) is not None and not is_row_parallel(m))
            for n, m in layers
        ]
        self.microbatch: int | None = None  # hooks record only while set
        self._handles = [h for i, st in enumerate(self.layers) for h in self._hook(i, st.module)]

    # ------------------------------------------------------------------ capture
    def _hook(self, index: int, module: nn.Module) -> list:
        state = self.layers[index]

        def forward_hook(mod: nn.Module, args: tuple, output: Tensor) -> None:
            k = self.microbatch
            if k is None or not torch.is_grad_enabled():
                return
            state.saved_inputs[k] = args[0].detach()
            if output.requires_grad:

                def grad_hook(grad: Tensor, k: int = k) -> None:
                    state.saved_grads[k] = grad.detach()
                    if self.loss_scale is not None:
                        state.saved_scales[k] = float(self.loss_scale())

                output.register_hook(grad_hook)

        return [module.register_forward_hook(forward_hook)]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pending(self) -> list[tuple[str, int, int]]:
        """Curvature tasks whose inputs are saved: ("A"|"B", layer, microbatch)."""
        out = []
        for i, st in enumerate(self.layers):
            out += [("A", i, k) for k in sorted(st.saved_inputs)]
            out += [("B", i, k) for k in sorted(st.saved_grads)]
        return out

    # ------------------------------------------------------------------ tasks
    def curvature_a(self, i: int, k: int) -> None:
        st = self.layers[i]
        a = fx.curvature_a(st.saved_inputs.pop(k), st.bias)
        st.a_sum = a if st.a_sum is None else st.a_sum + a
        st.a_count += 1

    def curvature_b(self, i: int, k: int) -> None:
        st = self.layers[i]
        b = fx.curvature_b(st.saved_grads.pop(k), self.grad_scale / st.saved_scales.pop(k, 1.0))
        st.b_sum = b if st.b_sum is None else st.b_sum + b
        st.b_count += 1

    def reduce_factors(self, i: int) -> None:
        """Mean over the refresh's microbatches, mean over data-parallel replicas, running average."""
        st = self.layers[i]
        if st.a_sum is None or st.b_sum is None:
            raise RuntimeError(f"K-FAC layer {st.name}: reduction before any curvature")
        new_a, new_b = st.a_sum / st.a_count, st.b_sum / st.b_count
        group = self.dp_group
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            size = dist.get_world_size(group)
            both = torch.cat([new_a.reshape(-1), new_b.reshape(-1)])
            dist.all_reduce(both, group=group)
            both /= size
            new_a = both[: new_a.numel()].view_as(new_a)
            new_b = both[new_a.numel() :].view_as(new_b)
        rho = self.config.factor_decay
        st.a = new_a if st.a is None else rho * st.a + (1 - rho) * new_a
        st.b = new_b if st.b is None else rho * st.b + (1 - rho) * new_b
        st.pi = fx.pi_damping(st.a, st.b)
        st.a_sum = st.b_sum = None
        st.a_count = st.b_count = 0

    def invert(self, i: int, which: str) -> None:
        """(A + π√λ I)⁻¹ (``which`` = "A") or (B + √λ/π I)⁻¹ (``which`` = "B")."""
        st = self.layers[i]
        root = self.config.damping**0.5
        if which == "A":
            st.a_inv = fx.cholesky_inverse(st.a, st.pi * root)
        elif which == "B":
            st.b_inv = fx.cholesky_inverse(st.b, root / st.pi)
        else:
            raise ValueError(f"invert: which must be 'A' or 'B', not {which!r}")

    def set_masters(self, masters: Mapping[int, Tensor]) -> None:
        """Mixed precision: ``masters`` maps id(model parameter) → the fp32 master parameter the
        optimizer steps. Preconditioning at the step (``stepped=True``) and :meth:`apply` then read and
        write the masters' (unscaled, clipped) fp32 gradients."""
        self.masters = dict(masters)

    def _grad(self, st: LayerState, stepped: bool) -> Tensor:
        """[∇W, ∇b] of the model's parameters or (``stepped``) of what the optimizer steps, in fp32."""

        def grad(p: Tensor | None) -> Tensor | None:
            return None if p is None else (self.masters.get(id(p), p) if stepped else p).grad

        return fx.grad_matrix(grad(st.module.weight), grad(st.module.bias) if st.bias else None)

    def precondition(self, i: int, *, stepped: bool = False) -> None:
        """V = B⁻¹ [∇W, ∇b] A⁻¹ from the current gradient (nothing before the first inversion): the
        model's gradient (e.g. in the tail bubble), or ``stepped``: the fp32 master gradient."""
        st = self.layers[i]
        w = st.module.weight
        w = self.masters.get(id(w), w) if stepped else w
        if st.a_inv is None or st.b_inv is None or w.grad is None:
            st.preconditioned = None
            return
        g = self._grad(st, stepped)
        st.preconditioned = st.b_inv @ g @ st.a_inv
        st.grad_norm = float(g.norm())

    def apply(self, lr: float) -> float:
        """KL-clip the preconditioned gradients and write them into the stepped parameters' ``.grad``
        (the fp32 masters under mixed precision); returns ν. A gradient scaled since its
        preconditioning (global-norm clipping, fp16 unscaling) scales its V alike (V is linear in it)."""
        ready = [st for st in self.layers if st.preconditioned is not None]
        pairs = []
        for st in ready:
            g = self._grad(st, True)
            now = float(g.norm())
            if st.grad_norm > 0 and abs(now - st.grad_norm) > 1e-12 * st.grad_norm:
                st.preconditioned = st.preconditioned * (now / st.grad_norm)
            pairs.append((st.preconditioned, g))
        nu = fx.kl_clip_scale(pairs, lr, self.config.kl_clip)
        for st in ready:
            v = st.preconditioned * nu
            w = self.masters.get(id(st.module.weight), st.module.weight)
            w.grad.copy_(v[:, : w.shape[1]].to(w.grad.dtype))
            if st.bias:
                b = self.masters.get(id(st.module.bias), st.module.bias)
                b.grad.copy_(v[:, -1].to(b.grad.dtype))
            st.preconditioned = None
        return nu

    def discard_recording(self) -> None:
        """Forget the refresh's captured tensors, curvature sums and preconditioned gradients (their
        iteration's optimizer step did not run: fp16 overflow or a skipped non-finite step)."""
        self.clear_saved()
        for st in self.layers:
            st.a_sum = st.b_sum = st.preconditioned = None
            st.a_count = st.b_count = 0

    # ------------------------------------------------------------------ serial use
    def run_pending_curvature(self) -> None:
        for which, i, k in self.pending():
            (self.curvature_a if which == "A" else self.curvature_b)(i, k)

    def refresh(self) -> None:
        """All pending curvature, then per layer reduction and both inversions (a whole refresh)."""
        self.run_pending_curvature()
        for i in range(len(self.layers)):
            self.reduce_factors(i)
            self.invert(i, "A")
            self.invert(i, "B")

    def precondition_all(self, lr: float) -> float:
        for i in range(len(self.layers)):
            self.precondition(i)
        return self.apply(lr)

    def clear_saved(self) -> None:
        for st in self.layers:
            st.saved_inputs.clear()
            st.saved_grads.clear()
            st.saved_scales.clear()
