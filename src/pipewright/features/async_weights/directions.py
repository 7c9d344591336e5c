"""Optimizer update directions D(W) read from live optimizer state, and PipeOptim's weight prediction.

D is defined so that the optimizer's next step, taken with a gradient equal to the latest one ``g``,
is exactly ``W ← W − lr·D(W)`` (PipeOptim, Guan et al. 2023, eq. 5-8, with the decoupled decay the
reference code leaves out):

* SGD (momentum μ, dampening τ, weight decay λ, optionally Nesterov): g' = g + λW,
  b' = μ·b + (1 − τ)·g' (b' = g' before the first step), D = b' or, Nesterov, D = g' + μ·b'.
* Adam (β₁, β₂, ε, L2 decay λ): g' = g + λW, m' = β₁m + (1 − β₁)g', v' = β₂v + (1 − β₂)g'²,
  t' = t + 1, D = (m'/(1 − β₁^t')) / (√(v'/(1 − β₂^t')) + ε).
* AdamW: the same with g' = g and the decoupled decay added: D = λW + m̂'/(√v̂' + ε).
* RMSprop (α, ε, λ, momentum μ): sq' = α·sq + (1 − α)g'², u = g'/(√sq' + ε); D = u, or with
  momentum D = μ·b + u.

Prediction over s updates (s from the schedule, :mod:`.staleness`): Ŵ = W − lr·s·D(W).

A new optimizer plugs in by defining ``update_direction(param, grad) -> Tensor | None`` on its class,
or by passing ``{OptimizerClass: fn}`` as ``extra`` to :func:`direction_fn`; no table is mutated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from pipewright.errors import ConfigError

#: fn(param, latest gradient or None, the optimizer's state for param, the param's group) → D or None.
DirectionFn = Callable[[torch.Tensor, "torch.Tensor | None", dict, dict], "torch.Tensor | None"]


def _refuse(group: dict, name: str, *keys: str) -> None:
    for key in keys:
        if group.get(key):
            raise ConfigError(f"weight prediction does not support {name}({key}=True); turn {key} off")


def _with_l2(w: torch.Tensor, g: torch.Tensor, wd: float) -> torch.Tensor:
    return g.add(w, alpha=wd) if wd else g


def sgd_direction(w: torch.Tensor, g: torch.Tensor | None, state: dict, group: dict) -> torch.Tensor | None:
    """torch.optim.SGD's next update per unit lr (see the module docstring)."""
    _refuse(group, "SGD", "maximize")
    if g is None:
        return None
    g = _with_l2(w, g, group["weight_decay"])
    mu, damp = group["momentum"], group["dampening"]
    if mu == 0:
        return g
    buf = state.get("momentum_buffer")
    nxt = g.clone() if buf is None else buf.mul(mu).add_(g, alpha=1 - damp)
    return g.add(nxt, alpha=mu) if group["nesterov"] else nxt


def _adam_core(w: torch.Tensor, g: torch.Tensor | None, state: dict, group: dict) -> torch.Tensor | None:
    if g is None:
        return None
    b1, b2 = group["betas"]
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    t = float(state["step"]) + 1 if "step" in state else 1.0
    m1 = g.mul(1 - b1) if m is None else m.mul(b1).add_(g, alpha=1 - b1)
    v1 = g.mul(g).mul_(1 - b2) if v is None else v.mul(b2).addcmul_(g, g, value=1 - b2)
    m_hat = m1.div_(1 - b1**t)
    denom = v1.div_(1 - b2**t).sqrt_().add_(group["eps"])
    return m_hat.div_(denom)


def adam_direction(w: torch.Tensor, g: torch.Tensor | None, state: dict, group: dict) -> torch.Tensor | None:
    """torch.optim.Adam (L2 decay inside the gradient)."""
    _refuse(group, "Adam", "amsgrad", "maximize")
    if g is None:
        return None
    return _adam_core(w, _with_l2(w, g, group["weight_decay"]), state, group)


def adamw_direction(w: torch.Tensor, g: torch.Tensor | None, state: dict, group: dict) -> torch.Tensor | None:
    """torch.optim.AdamW: the Adam direction plus the decoupled decay λ·W (absent from PipeOptim's code)."""
    _refuse(group, "AdamW", "amsgrad", "maximize")
    d = _adam_core(w, g, state, group)
    if d is None:
        return None
    wd = group["weight_decay"]
    return d.add_(w, alpha=wd) if wd else d


def rmsprop_direction(
    w: torch.Tensor, g: torch.Tensor | None, state: dict, group: dict
) -> torch.Tensor | None:
    """torch.optim.RMSprop (not centered)."""
    _refuse(group, "RMSprop", "centered", "maximize")
    if g is None:
        return None
    g = _with_l2(w, g, group["weight_decay"])
    alpha = group["alpha"]
    sq = state.get("square_avg")
    sq1 = g.mul(g).mul_(1 - alpha) if sq is None else sq.mul(alpha).addcmul_(g, g, value=1 - alpha)
    u = g.div(sq1.sqrt_().add_(group["eps"]))
    mu = group["momentum"]
    if mu > 0:
        buf = state.get("momentum_buffer")
        return u if buf is None else buf.mul(mu).add_(u)
    return u


#: The built-in directions, by optimizer class (read-only; extend through ``extra`` or a method).
BUILTIN: Mapping[type, DirectionFn] = MappingProxyType(
    {
        torch.optim.SGD: sgd_direction,
        torch.optim.Adam: adam_direction,
        torch.optim.AdamW: adamw_direction,
        torch.optim.RMSprop: rmsprop_direction,
    }
)


def direction_fn(
    optimizer: torch.optim.Optimizer, extra: Mapping[type, DirectionFn] | None = None
) -> DirectionFn:
    """The direction of ``optimizer``: its own ``update_direction`` method, else ``extra`` or
    :data:`BUILTIN` by exact class (a subclass may change the update rule, so no isinstance match)."""
    method = getattr(optimizer, "update_direction", None)
    if method is not None:
        return lambda w, g, state, group: method(w, g)
    table = {**BUILTIN, **(extra or {})}
    fn = table.get(type(optimizer))
    if fn is None:
        names = ", ".join(c.__name__ for c in table)
        raise ConfigError(
            f"weight prediction has no update direction for {type(optimizer).__name__}; use one of {names} "
            "or give the optimizer an update_direction(param, grad) method"
        )
    return fn


def directions(
    optimizer: torch.optim.Optimizer,
    grads: Mapping[torch.Tensor, torch.Tensor] | Callable[[torch.Tensor], Any],
    extra: Mapping[type, DirectionFn] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None, float]]:
    """(param, D(param) or None, lr) for every parameter of ``optimizer``; ``grads`` gives the latest
    gradient of a parameter (a mapping keyed by the parameter, or a function)."""
    fn = direction_fn(optimizer, extra)
    get = grads.get if isinstance(grads, Mapping) else grads
    out = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append((p, fn(p.detach(), get(p), optimizer.state.get(p, {}), group), float(group["lr"])))
    return out


def predict_into(
    targets: Mapping[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    grads: Mapping[torch.Tensor, torch.Tensor] | Callable[[torch.Tensor], Any],
    s: int,
    extra: Mapping[type, DirectionFn] | None = None,
) -> None:
    """Write Ŵ = W − lr·s·D(W) into ``targets[param]`` for each parameter (W itself is not touched;
    a parameter without a direction yet gets Ŵ = W)."""
    with torch.no_grad():
        for p, d, lr in directions(optimizer, grads, extra):
            out = targets.get(p)
            if out is None:
                continue
            out.copy_(p)
            if d is not None and s > 0:
                out.add_(d, alpha=-lr * s)
