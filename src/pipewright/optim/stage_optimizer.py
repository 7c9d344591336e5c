"""Optimizers for a rank's stage parameters, the learning-rate schedule and global-norm clipping.

Each rank optimizes only the parameters of the stages it holds (torch.optim over those tensors). What
keeps training identical whatever the layout: the loss is the mean over the global batch (the
executor scales each microbatch's loss by 1/(m·dp) and sums over data-parallel replicas), and the
gradient norm used for clipping is the norm of the *whole* model's gradient, summed over the pipeline
ranks of one replica (each parameter counted once; replicas agree after the gradient reduction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

from pipewright.errors import ConfigError


def _param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, LayerNorm or position vectors' 1-D tensors)."""
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


#: Where AdamW runs PyTorch's fused kernel: CUDA, and the meta tensors that stand for a device run
#: when the program is measured without one (:mod:`pipewright.measure`). The CPU keeps the for-loop
#: implementation, whose numerics the CPU runs and their tests were made with.
FUSED_DEVICES = frozenset({"cuda", "meta"})
#: The parameter dtypes PyTorch's fused AdamW takes.
FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def adamw_fused(params: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`_adamw` builds PyTorch's fused AdamW for ``params``: every one a dense tensor of a
    dtype in :data:`FUSED_DTYPES` on one device type of :data:`FUSED_DEVICES`. The fused step updates
    the parameters and both moments in one kernel per group of tensors and allocates no temporaries
    (as Megatron's fused Adam); the foreach step holds about 4 bytes a parameter of them at once, the
    for-loop one two fp32 tensors of the largest parameter."""
    kinds = {p.device.type for p in params}
    return (
        len(kinds) == 1
        and kinds <= FUSED_DEVICES
        and all(p.dtype in FUSED_DTYPES and p.layout == torch.strided for p in params)
    )


def _adamw(named, lr: float, weight_decay: float, betas=(0.9, 0.95), **_) -> torch.optim.Optimizer:
    groups = _param_groups(named, weight_decay)
    fused = adamw_fused([p for g in groups for p in g["params"]])
    impl = {"fused": True} if fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **impl)


def _sgd(named, lr: float, weight_decay: float, momentum: float = 0.9, **_) -> torch.optim.Optimizer:
    return torch.optim.SGD(_param_groups(named, weight_decay), lr=lr, momentum=momentum, foreach=False)


#: Optimizer name → builder(named_parameters, lr, weight_decay, **options). A feature may provide
#: more names (``Feature.optimizers``); its training plugin wraps or replaces the optimizer the trainer
#: builds for them, :data:`FEATURE_BASE`.
OPTIMIZERS: Mapping[str, Callable[..., torch.optim.Optimizer]] = MappingProxyType(
    {"adamw": _adamw, "sgd": _sgd}
)
#: What the trainer builds under an optimizer name a feature provides, before the feature's plugin
#: wraps or replaces it.
FEATURE_BASE = "adamw"


def base_optimizer(name: str) -> str:
    """The optimizer of :data:`OPTIMIZERS` the trainer builds for ``name``: itself, or
    :data:`FEATURE_BASE` for a name a feature provides (checked before any worker starts)."""
    return name if name in OPTIMIZERS else FEATURE_BASE


def build_optimizer(
    name: str, named_params: Iterable[tuple[str, nn.Parameter]], *, lr: float, weight_decay: float = 0.1
) -> torch.optim.Optimizer:
    """AdamW (β = 0.9, 0.95) or SGD with momentum 0.9 over the given parameters."""
    try:
        builder = OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}") from None
    return builder(list(named_params), lr=lr, weight_decay=weight_decay)


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio``·lr at ``total``:
    lr·(k+1)/warmup for k < warmup; else lr·(r + (1 − r)·½(1 + cos(π·t))), t = (k − warmup)/(total − warmup).
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


#: Elements per block whose norm is taken in the gradient's own precision (see _sum_of_squares).
NORM_BLOCK = 1 << 16


def _sum_of_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ over ``grads`` of Σ g², in float64. Each gradient is cut into blocks of ``NORM_BLOCK`` elements
    whose 2-norms are taken in float32 (one reduction per tensor, no float64 copy of the gradient), and
    the blocks' squares are summed in float64: a float32 sum over a whole large tensor drifts (≈ 3e-3
    relative at 4·10⁷ elements on CPU), one over 65,536 elements stays ≈ 1e-7. Should a block's
    float32 sum overflow (‖g‖ ≳ 1.8·10¹⁹), the exact float64 sum is taken instead."""
    parts = []
    for g in grads:
        flat = g.reshape(-1).float()
        whole = flat.numel() // NORM_BLOCK * NORM_BLOCK
        if whole:
            parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, NORM_BLOCK), dim=1))
        if whole < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    if not parts:  # only empty gradients (a rank whose shard holds no counted element)
        return torch.zeros((), dtype=torch.float64, device=grads[0].device)
    norms = torch.cat(parts).double()
    sq = (norms * norms).sum()
    if not torch.isfinite(sq):
        sq = sum(
            (g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=sq.device)
        )
    return sq


def global_grad_norm(
    params: Sequence[torch.Tensor], groups: Sequence[object] = (), device: torch.device | None = None
) -> torch.Tensor:
    """‖g‖₂ of the whole model: Σ‖g_p‖² over this rank's parameters, all-reduced (sum) over each
    process group in ``groups`` (the pipeline group: ranks holding disjoint parts of one replica).

    The all-reduced term lives on the gradients' device; a rank without gradients (an expert-only
    rank whose experts saw no token) puts its zero on ``device``, else on its parameters' device —
    never on the CPU for a NCCL group, which takes only CUDA tensors."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    device = grads[0].device if grads else _norm_device(params, device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        sq = _sum_of_squares(grads)
    for group in groups:
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt()


def _norm_device(params: Sequence[torch.Tensor], device: torch.device | None) -> torch.device:
    """Where a rank without gradients puts its norm term: ``device``, else its parameters' device,
    else the current CUDA device when a NCCL default group runs, else the CPU."""
    if device is not None:
        return torch.device(device)
    for p in params:
        if isinstance(p, torch.Tensor):
            return p.device
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_grad_norm_(
    params: Sequence[torch.Tensor],
    max_norm: float,
    groups: Sequence[object] = (),
    *,
    norm_params: Sequence[torch.Tensor] | None = None,
) -> float:
    """Scale the gradients of ``params`` by min(1, max_norm/‖g‖) with ‖g‖ the global norm of
    ``norm_params`` (default ``params``; under tensor parallelism: the shards plus the replicated
    parameters of one tp rank, so that the sum over ``groups`` counts each element once); returns ‖g‖
    before clipping. ``max_norm`` ≤ 0 disables clipping (the norm is still computed)."""
    device = _norm_device(params, None) if params else None
    norm = global_grad_norm(params if norm_params is None else norm_params, groups, device)
    total = float(norm)
    if max_norm > 0 and total > max_norm:
        scale_grads_(params, max_norm / (total + 1e-6))
    return total


def scale_grads_(params: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply every gradient of ``params`` by ``factor`` in place (one fused call)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily-made state (for loading a checkpoint into it) without changing the
    parameters: one step with zero gradients and lr = 0."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
