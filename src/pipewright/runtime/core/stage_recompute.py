"""Activation recomputation per stage, applied to the stage module so the executor does not change.

Modes (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022):

- ``none``: every activation the backward needs is kept from the forward.
- ``selective``: only the attention core softmax(QKᵀ/√d)V (:class:`~pipewright.models.blocks.AttentionCore`)
  is recomputed: its inputs q, k, v are kept, what it stores internally (the a·s² scores and softmax
  on kernels that keep them) is dropped and rebuilt in the backward.
- ``full``: each transformer layer keeps only its input; its forward runs again inside the backward
  (Megatron's "full/uniform" recomputation with one layer per checkpoint).

Both use PyTorch's non-reentrant ``torch.utils.checkpoint``: the recomputed forward runs when the
backward first needs a saved tensor, i.e. inside the backward pass that reaches it. With the split
backward (I/W) that is the I pass: the linear layers' backward then runs on the recomputed inputs and,
when deferring, hands (x, ∂L/∂y) to the weight-gradient store as usual, so W needs no recomputation
(Zero Bubble's accounting, which the cost model follows). No RNG state is saved: the models have no
dropout, so a recomputed forward is bit-identical to the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from pipewright.errors import ConfigError
from pipewright.models.blocks import AttentionCore

RECOMPUTE_MODES = ("none", "selective", "full")


class _Checkpointed:
    """A module's forward run under ``torch.utils.checkpoint`` (set as the instance's ``forward``, so
    parameter names and state dicts are unchanged)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.inner = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # keywords: transformers' decoder layers
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def _checkpoint_module(module: nn.Module) -> None:
    if isinstance(module.forward, _Checkpointed):
        return
    module.forward = _Checkpointed(module.forward)


def recomputed_modules(stage: nn.Module, mode: str) -> list[nn.Module]:
    """The modules of ``stage`` whose forward ``mode`` recomputes: the transformer layers
    (``stage.layers``) for full, the attention cores for selective, none for none."""
    check_recompute(mode)
    if mode == "full":
        return list(getattr(stage, "layers", {}).values())
    if mode == "selective":
        return [m for m in stage.modules() if isinstance(m, AttentionCore)]
    return []


def apply_recompute(stage: nn.Module, mode: str) -> nn.Module:
    """Make ``stage`` recompute activations as ``mode`` says (in place; returns ``stage``)."""
    for module in recomputed_modules(stage, mode):
        _checkpoint_module(module)
    return stage


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)} (got {mode!r})")
