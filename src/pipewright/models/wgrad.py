"""Split backward for zero-bubble schedules: input gradients now (I), weight gradients later (W).

A linear layer ``y = x Wᵀ + b`` has three backward products (Qi et al., Zero Bubble, ICLR 2024, §2):

    ∂L/∂x = ∂L/∂y · W          (needed by the previous stage: the I pass)
    ∂L/∂W = (∂L/∂y)ᵀ · x       (needed only by the optimizer: the W pass)
    ∂L/∂b = Σ_rows ∂L/∂y

:class:`DeferrableLinear` computes all three in an ordinary backward. Inside
``defer_weight_grads(store, module, key=k)`` its backward computes ∂L/∂x only and appends
``(layer, x, ∂L/∂y)`` to ``store`` under ``k``; ``store.flush(k)`` later computes ∂L/∂W and ∂L/∂b from
them and accumulates into ``.grad``. The arithmetic of I + W is exactly one full backward; the
autograd graph is not run twice. Other parameters (LayerNorm, embeddings) get their gradients in I.

The deferral switch lives on the layer instances (not in a global or thread-local): autograd may run
backward functions on another thread (one per CUDA device), where a context variable is not visible.

The linear-layer factories the model builders take (``factory(in, out, *, bias, kind)``) live here too:
:func:`plain_linear_factory` (``nn.Linear``), :func:`default_linear_factory` (DeferrableLinear) and
:func:`linear_factory_for` (the one a schedule needs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pipewright.ir import I, Schedule, W

#: ``factory(in_features, out_features, *, bias, kind) -> nn.Module`` (kinds: models.gpt.LINEAR_KINDS)
LinearFactory = Callable[..., nn.Module]

#: a W pass's input X: the tensor, or a function making it when W runs (a sequence-parallel linear
#: keeps its 1/t sequence shard and all-gathers it only then, as Megatron's backward does)
WeightInput = torch.Tensor | Callable[[], torch.Tensor]


def weight_input(x: WeightInput) -> torch.Tensor:
    """The W pass's X: ``x`` itself, or ``x()`` when it is made on demand."""
    return x if isinstance(x, torch.Tensor) else x()


class WeightGradStore:
    """Deferred weight-gradient work, grouped by key (the microbatch)."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, list[tuple[DeferrableLinear, WeightInput, torch.Tensor]]] = defaultdict(
            list
        )

    def put(self, key: Hashable, layer: DeferrableLinear, x: WeightInput, grad_out: torch.Tensor) -> None:
        self._pending[key].append((layer, x, grad_out))

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def __bool__(self) -> bool:
        return True  # a store is a store even when empty (``store or default`` must not skip it)

    def keys(self) -> list[Hashable]:
        return list(self._pending)

    def flush(self, key: Hashable | None = None, done: Callable[[nn.Module], None] | None = None) -> None:
        """Compute and accumulate the deferred gradients of ``key`` (all keys when None); ``done(layer)``
        after each layer's (e.g. to start a gradient reduction as soon as its weights are final)."""
        keys = list(self._pending) if key is None else [key]
        with torch.no_grad():
            for k in keys:
                for layer, x, grad_out in self._pending.pop(k, ()):
                    _accumulate_weight_grads(layer, x, grad_out)
                    if done is not None:
                        done(layer)


def weight_grads(
    x: torch.Tensor, grad_out: torch.Tensor, bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """∂L/∂W = (∂L/∂y)ᵀ x and ∂L/∂b = Σ ∂L/∂y over all leading dimensions."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
    return grad_w, (g2.sum(0) if bias else None)


def _accumulate_weight_grads(layer: nn.Linear, x: WeightInput, grad_out: torch.Tensor) -> None:
    """``W.grad += (∂L/∂y)ᵀ x`` and ``b.grad += Σ ∂L/∂y``, the weight product fused into the
    accumulation (one GEMM with β = 1, ``addmm_``) so no separate gradient tensor is written and re-read."""
    weight, bias = layer.weight, layer.bias
    if not weight.requires_grad:
        return  # a frozen layer (its bias is frozen with it)
    x = weight_input(x)
    if weight.grad is None or weight.grad.dtype != grad_out.dtype or not weight.grad.is_contiguous():
        grad_w, grad_b = weight_grads(x, grad_out, bias is not None)
        _accumulate(weight, grad_w)
        if grad_b is not None:
            _accumulate(bias, grad_b)
        return
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    weight.grad.addmm_(g2.t(), x.reshape(-1, x.shape[-1]))
    if bias is not None:
        _accumulate(bias, g2.sum(0))


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        layer: DeferrableLinear = ctx.layer
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        store, key = layer._defer
        if store is not None:
            store.put(key, layer, x.detach(), grad_out.detach())
            return grad_x, None, None, None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_w, grad_b = weight_grads(x, grad_out, ctx.has_bias)
        return grad_x, grad_w, grad_b, None


class DeferrableLinear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state_dict keys) whose weight gradient can be deferred."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._defer: tuple[WeightGradStore | None, Hashable] = (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self)


class AccumulateNow(WeightGradStore):
    """The "store" of a full backward (B): ``put`` accumulates ``W.grad += (∂L/∂y)ᵀ x`` at once, fused
    into one GEMM (``addmm_``), instead of returning ∂L/∂W to autograd, which would write a new tensor
    and then add it into ``.grad`` (Megatron-LM's gradient-accumulation fusion does the same, into its
    ``main_grad``). Gradients are only ever accumulated into ``.grad``: use it where the caller runs
    ``torch.autograd.backward``, not ``torch.autograd.grad``."""

    def put(self, key: Hashable, layer: DeferrableLinear, x: WeightInput, grad_out: torch.Tensor) -> None:
        with torch.no_grad():
            _accumulate_weight_grads(layer, x, grad_out)


def deferrable_layers(*modules: nn.Module) -> list[nn.Module]:
    """The layers inside ``modules`` that follow the deferral protocol (DeferrableLinear and the
    tensor-parallel linear layers): find them once, switch them per backward with :func:`deferring`."""
    return [m for module in modules for m in module.modules() if hasattr(m, "_defer")]


@contextmanager
def deferring(layers: list[nn.Module], store: WeightGradStore, key: Hashable = None) -> Iterator[None]:
    """While active, the backward of ``layers`` hands its weight-gradient work to ``store`` under
    ``key`` (``store.put``)."""
    previous = [layer._defer for layer in layers]
    for layer in layers:
        layer._defer = (store, key)
    try:
        yield
    finally:
        for layer, prev in zip(layers, previous, strict=True):
            layer._defer = prev


def defer_weight_grads(store: WeightGradStore, *modules: nn.Module, key: Hashable = None):
    """While active, backward through any DeferrableLinear inside ``modules`` defers its weight and
    bias gradients to ``store`` under ``key`` (run the backward inside the ``with`` block)."""
    return deferring(deferrable_layers(*modules), store, key)


def plain_linear_factory(in_features: int, out_features: int, *, bias: bool, kind: str) -> nn.Module:
    """``nn.Linear``: PyTorch's own layer (no split backward)."""
    return nn.Linear(in_features, out_features, bias=bias)


def default_linear_factory(in_features: int, out_features: int, *, bias: bool, kind: str) -> nn.Module:
    """:class:`DeferrableLinear`: an ``nn.Linear`` whose weight gradient can be deferred."""
    return DeferrableLinear(in_features, out_features, bias=bias)


def shared_input(x: torch.Tensor, *layers: nn.Module) -> torch.Tensor:
    """The tensor ``layers`` — linear layers that all read ``x`` (q, k, v; gate, up) — are then called
    with: what their ``share_input(x, layers)`` makes of it when they have one (the tensor-parallel
    column linears: ``x`` gathered or entered once for all, with one reduce-scatter or all-reduce of
    the summed input gradients, as Megatron's fused QKV and gate/up linears run), else ``x``."""
    share = getattr(layers[0], "share_input", None)
    return x if share is None else share(x, layers)


def splits_backward(schedule: Schedule) -> bool:
    """True when ``schedule`` runs input- and weight-gradient passes (I / W) as separate actions."""
    return any(a.kind in (I, W) for row in schedule.actions for a in row)


def linear_factory_for(schedule: Schedule) -> LinearFactory:
    """The linear layers a schedule's stages need: :class:`DeferrableLinear` when it splits the backward
    (its W pass and the fused weight-gradient accumulation), else ``nn.Linear`` — PyTorch's C++ autograd
    node costs fewer Python calls per layer than an ``autograd.Function``, which is what a small,
    overhead-bound model pays for (``benchmarks/bench_vs_torch.py``)."""
    return default_linear_factory if splits_backward(schedule) else plain_linear_factory
