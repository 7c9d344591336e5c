"""The linear layers of a Hugging Face stage, rebuilt for what the schedule and the layout need.

The runtime passes a linear factory (:mod:`pipewright.models.wgrad`): ``plain_linear_factory`` keeps
the model's own layers; ``default_linear_factory`` (schedules with split I/W backward, Qi et al., Zero
Bubble, ICLR 2024) turns every ``nn.Linear`` into a :class:`~pipewright.models.wgrad.DeferrableLinear`
and GPT-2's ``Conv1D`` (y = x·W + b, W stored [in, out]) into :class:`DeferrableConv1D` — in place, same
parameters, so tied weights stay tied; any other factory (tensor parallelism) builds each linear layer
anew from its kind (column- or row-parallel, :data:`~pipewright.models.hf.adapters.LLAMA_TP`), loaded
with the full-size weight through ``load_full_``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.wgrad import (
    DeferrableLinear,
    LinearFactory,
    default_linear_factory,
    plain_linear_factory,
    shared_input,
)


class _Transposed(NamedTuple):
    """What the W pass of a ``Conv1D`` updates, seen as a linear layer: ``weight`` [in, out] and no bias
    (the bias gradient Σ ∂L/∂y is taken in the I pass)."""

    weight: nn.Parameter
    bias: None


class _Conv1DFn(torch.autograd.Function):
    """y = x·W + b with W [in, out]. Backward: ∂L/∂x = ∂L/∂y·Wᵀ, ∂L/∂b = Σ ∂L/∂y, and ∂L/∂W = xᵀ·∂L/∂y,
    deferred while ``layer._defer`` holds a store: the store's product (∂L/∂y)ᵀ·x of a linear layer,
    given (∂L/∂y, x) swapped, is exactly xᵀ·∂L/∂y."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, layer) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)
        return out.view(*x.shape[:-1], weight.shape[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight.t()) if ctx.needs_input_grad[0] else None
        g2 = g.reshape(-1, g.shape[-1])
        grad_b = g2.sum(0) if ctx.needs_input_grad[2] else None
        store, key = ctx.layer._defer
        if store is not None:
            store.put(key, _Transposed(ctx.layer.weight, None), g.detach(), x.detach())
            return grad_x, None, grad_b, None
        grad_w = x.reshape(-1, x.shape[-1]).t().mm(g2) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, grad_b, None


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is present whenever a stage is built
        return None
    return Conv1D


def _deferrable_conv1d(conv_cls: type) -> type:
    class DeferrableConv1D(conv_cls):
        """GPT-2's ``Conv1D`` (same parameters) whose weight gradient can be deferred."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Conv1DFn.apply(x, self.weight, self.bias, self)

    return DeferrableConv1D


def make_deferrable_(module: nn.Module) -> None:
    """Turn every ``nn.Linear`` / ``Conv1D`` inside ``module`` into its deferrable form, in place."""
    conv = _conv1d_class()
    deferrable_conv = _deferrable_conv1d(conv) if conv is not None else None
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = DeferrableLinear
        elif conv is not None and type(m) is conv:
            m.__class__ = deferrable_conv
        else:
            continue
        m._defer = (None, None)


def rebuild_linears_(
    layer: nn.Module, make: LinearFactory, kinds: dict[str, str], where: str, model_type: str
) -> None:
    """Replace each linear layer in ``layer`` by ``make(in, out, bias=…, kind=kinds[name])`` holding the
    same full-size weights; a linear layer (or GPT-2 Conv1D) with no kind: one-line ConfigError."""
    conv = _conv1d_class()
    for path, m in list(layer.named_modules()):
        is_conv = conv is not None and isinstance(m, conv)
        if not (isinstance(m, nn.Linear) or is_conv):
            continue
        parent_path, _, attr = path.rpartition(".")
        kind = kinds.get(attr)
        if kind is None or is_conv:
            raise ConfigError(
                f"tensor parallelism: no column/row split for {where}.{path} of model_type "
                f"{model_type!r} (fused or unknown projection); use --tp 1"
            )
        setattr(layer.get_submodule(parent_path) if parent_path else layer, attr, rebuilt(m, make, kind))


#: projections of one module that read the same input: under tensor parallelism each group shares
#: it (one all-reduce of their summed input gradients, as Megatron's fused QKV and gate/up linears)
SHARED_INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def share_inputs_(layer: nn.Module) -> None:
    """Make every module of ``layer`` that holds a group of :data:`SHARED_INPUT_GROUPS` call the group
    on one shared input (:func:`~pipewright.models.wgrad.shared_input`, through a forward pre-hook on
    the module's ``hidden_states``, positional or by name)."""
    for module in layer.modules():
        for names in SHARED_INPUT_GROUPS:
            if all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                module.register_forward_pre_hook(partial(_share_input_hook, names), with_kwargs=True)


def _share_input_hook(
    names: tuple[str, ...], module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    linears = [getattr(module, n) for n in names]
    if args:
        return (shared_input(args[0], *linears), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": shared_input(kwargs["hidden_states"], *linears)}
    return None


def rebuilt(linear: nn.Linear, make: LinearFactory, kind: str) -> nn.Module:
    """``make``'s layer of ``kind`` for ``linear``'s shape, holding ``linear``'s (full-size) weights."""
    new = make(linear.in_features, linear.out_features, bias=linear.bias is not None, kind=kind)
    with torch.no_grad():
        if hasattr(new, "load_full_"):
            new.load_full_(linear.weight, linear.bias)
        else:
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


def keeps_layers(make: LinearFactory) -> bool:
    """The plain factory: the model's own layers stay."""
    return make is plain_linear_factory


def defers_in_place(make: LinearFactory) -> bool:
    """The deferrable factory: the layers are converted in place (:func:`make_deferrable_`)."""
    return make is default_linear_factory
