"""Optimizers, learning-rate schedule and global gradient clipping for pipeline training (torch)."""

from pipewright.optim.stage_optimizer import (
    FEATURE_BASE,
    OPTIMIZERS,
    base_optimizer,
    build_optimizer,
    clip_grad_norm_,
    global_grad_norm,
    init_optimizer_state,
    lr_at,
    scale_grads_,
    set_lr,
)

__all__ = [
    "FEATURE_BASE",
    "OPTIMIZERS",
    "base_optimizer",
    "build_optimizer",
    "clip_grad_norm_",
    "global_grad_norm",
    "init_optimizer_state",
    "lr_at",
    "scale_grads_",
    "set_lr",
]
