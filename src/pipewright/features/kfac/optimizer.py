"""The K-FAC optimizer: precondition the covered layers' gradients, then the configured first-order
update (SGD with momentum, AdamW, or LAMB-style) over *all* parameters — layers K-FAC does not cover
(LayerNorm, embeddings, the output layer) simply get their raw gradient (the first-order path)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pipewright.errors import ConfigError
from pipewright.features.kfac.kfac import KFAC
from pipewright.features.kfac.options import BASE_UPDATES
from pipewright.optim.stage_optimizer import _param_groups


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020): Adam's direction u = m̂/(√v̂ + ε) + λ·w, scaled per tensor by the trust
    ratio ‖w‖/‖u‖ (1 when either norm is 0): w ← w − lr·(‖w‖/‖u‖)·u."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["m"] / (1 - b1 ** st["step"])
                v_hat = st["v"] / (1 - b2 ** st["step"])
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                wn, un = float(p.norm()), float(u.norm())
                trust = wn / un if wn > 0 and un > 0 else 1.0
                p.add_(u, alpha=-group["lr"] * trust)


def build_base(name: str, named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float):
    """The first-order update K-FAC's preconditioned gradient feeds (``--kfac-base``): "sgd" (momentum
    0.9), "adamw" (β = 0.9, 0.95, as ``--optimizer adamw``) or "lamb" (:class:`Lamb`); weight decay on
    matrices only."""
    groups = _param_groups(list(named), weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    if name == "lamb":
        return Lamb(groups, lr=lr)
    raise ConfigError(f"unknown K-FAC base update {name!r}; choose one of: {', '.join(BASE_UPDATES)}")


class KFACOptimizer:
    """Step counter and intervals around a :class:`KFAC` and a base optimizer.

    Per step t (0-based): when t % factor_interval == 0 the hooks record (:meth:`record`), and at the
    step the pending curvature runs and the factors are reduced; when t % inv_interval == 0 the factors
    are inverted; then every covered gradient is preconditioned and KL-clipped, and the base step runs.
    (In the pipeline the same tasks run earlier, in the bubbles; what is left runs here.)"""

    def __init__(self, kfac: KFAC, base: torch.optim.Optimizer) -> None:
        self.kfac, self.base = kfac, base
        self.steps = 0

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def state(self):
        return self.base.state

    def record(self) -> bool:
        """Whether this step's microbatches feed the factors."""
        return self.steps % self.kfac.config.factor_interval == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> float:
        cfg, kfac = self.kfac.config, self.kfac
        if self.record():
            kfac.run_pending_curvature()
            for i in range(len(kfac.layers)):
                if kfac.layers[i].a_count:
                    kfac.reduce_factors(i)
        if self.steps % cfg.inv_interval == 0:
            for i, st in enumerate(kfac.layers):
                if st.a is not None:
                    kfac.invert(i, "A")
                    kfac.invert(i, "B")
        kfac.clear_saved()
        nu = kfac.precondition_all(self.base.param_groups[0]["lr"])
        self.base.step()
        self.steps += 1
        return nu

    def state_dict(self) -> dict:
        return {"base": self.base.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.base.load_state_dict(state["base"])
        self.steps = state["steps"]
