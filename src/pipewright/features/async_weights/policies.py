"""Weight policies of an asynchronous pipeline stage: which weights a microbatch's forward and backward
see, and when the optimizer updates. One class per policy, registered by name in :data:`POLICIES`.

* ``none``: forward and backward on the live weights at the time each runs (PipeDream without
  stashing: stale and inconsistent).
* ``stash``: the backward uses the very weights its forward used (PipeDream, SOSP 2019); a version is
  copied only when an update would overwrite a version still referenced, so rank r holds at most
  p − r versions in 1F1B.
* ``2bw``: PipeDream-2BW (Narayanan et al., ICML 2021): gradients accumulated over ``period`` (= m ≥ p)
  microbatches, one update per period, W_{t+1} = W_t − η·∇f(W_{t−1}): microbatches of period t run
  forward and backward on the previous version, so two versions are held (one with a single stage:
  there nothing is in flight and the delay is 0).
* ``predict``: PipeOptim (Guan et al. 2023): forward on Ŵ = W − lr·s·D(W) written into one buffer per
  stage, backward and update on the live weights, which are never written by the prediction.
* ``dc``: stash plus delay compensation of the stale gradient (DC-ASGD, Zheng et al., ICML 2017):
  g̃ = g + λ·g⊙g⊙(W_now − W_fwd), with λ = λ₀/√(mean g²) of a running average (DC-ASGD-a).
* ``nesterov``: stash plus a Nesterov look-ahead update (Ajanthan et al., "Nesterov Method for
  Asynchronous Pipeline Parallel Optimization", ICML 2025), as the authors' code (AsyncPP) runs it:
  the stage's optimizer becomes its Nesterov form, AdamW → NAdam with decoupled decay and β₁ = 0.99
  (:func:`nesterov_optimizer`), SGD with momentum → SGD with Nesterov momentum.

A policy that changes the update rule itself names it in :data:`OPTIMIZER_RULES` (policy → function
of the run's optimizer); :func:`policy_optimizer` applies it once per optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from pipewright.errors import ConfigError
from pipewright.features.async_weights.directions import predict_into

if TYPE_CHECKING:
    from pipewright.features.async_weights.runtime import AsyncStage

Weights = list[torch.Tensor]


class WeightPolicy:
    """Base: live weights everywhere, one update per microbatch."""

    name = "none"
    #: update only after this many backwards (``None``: every STEP)
    period: int | None = None
    #: keep the latest gradient after the update (prediction's D(W) reads it)
    needs_gradient = False

    def forward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        """Tensors the forward of microbatch k runs on (None: the live weights)."""
        return None

    def backward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        """Tensors the backward of k reads where its forward saved weights (None: live, then)."""
        return None

    def after_backward(self, st: AsyncStage, k: int) -> None: ...

    def before_update(self, st: AsyncStage) -> None:
        """Called right before the optimizer writes the live weights."""

    def adjust_grads(self, st: AsyncStage, ks: list[int]) -> None:
        """Change the gradients of microbatches ``ks`` before the update (delay compensation)."""

    def after_update(self, st: AsyncStage) -> None: ...

    def copies(self) -> int:
        """Weight copies this policy holds now, besides the live weights."""
        return 0

    def carried(self, st: AsyncStage) -> dict[str, Weights]:
        """Tensors (one per stage parameter) this policy carries from one window to the next, which a
        checkpoint must hold for a resumed run to go on as an uninterrupted one."""
        return {}

    def restore(self, st: AsyncStage, carried: dict[str, Weights]) -> None:
        """Take back what :meth:`carried` gave (from a checkpoint)."""


class Stash(WeightPolicy):
    name = "stash"

    def __init__(self) -> None:
        self.at_forward: dict[int, int] = {}  # microbatch → version its forward saw
        self.saved: dict[int, Weights] = {}  # version → copy (only versions already overwritten)

    def forward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        self.at_forward[k] = st.version
        return None  # live weights equal this version now; copied lazily before they change

    def backward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        return self.saved.get(self.at_forward[k])

    def after_backward(self, st: AsyncStage, k: int) -> None:
        self.at_forward.pop(k)
        self.release()

    def release(self) -> None:
        live = set(self.at_forward.values())
        for v in [v for v in self.saved if v not in live]:
            del self.saved[v]

    def before_update(self, st: AsyncStage) -> None:
        self.release()
        if st.version in self.at_forward.values() and st.version not in self.saved:
            self.saved[st.version] = [p.detach().clone() for p in st.live]

    def copies(self) -> int:
        return len(self.saved)


class DelayCompensated(Stash):
    name = "dc"

    def __init__(self, lam: float = 2.0, beta: float = 0.95) -> None:
        super().__init__()
        self.lam, self.beta = lam, beta
        self.mean_sq: Weights | None = None
        self.kept: dict[int, Weights | None] = {}  # microbatch → its forward weights (None: live)

    def after_backward(self, st: AsyncStage, k: int) -> None:
        v = self.at_forward.pop(k)
        self.kept[k] = self.saved.get(v)  # None: the version is still the live one (no delay)
        self.release()

    def adjust_grads(self, st: AsyncStage, ks: list[int]) -> None:
        grads = [p.grad for p in st.params]
        if self.mean_sq is None:
            self.mean_sq = [g.detach() * g.detach() for g in grads]
        else:
            for ms, g in zip(self.mean_sq, grads, strict=True):
                ms.mul_(self.beta).addcmul_(g, g, value=1 - self.beta)
        fwd = [self.kept.pop(k, None) for k in ks]
        if len(fwd) != 1 or fwd[0] is None:  # no delay (or several microbatches: not compensated)
            return
        for g, w_now, w_fwd, ms in zip(grads, st.live, fwd[0], self.mean_sq, strict=True):
            lam = self.lam / (ms.mean().sqrt() + 1e-12)
            g.add_(g * g * (w_now - w_fwd) * lam)

    def copies(self) -> int:
        held = {id(w) for w in self.saved.values()} | {id(w) for w in self.kept.values() if w is not None}
        return len(held)


class TwoBufferedWeights(WeightPolicy):
    name = "2bw"

    def __init__(self, period: int, delay: int) -> None:
        self.period, self.delay = period, delay
        self.shadow: Weights | None = None  # version updates − 1, kept when delay > 0

    def _weights(self, st: AsyncStage, k: int) -> Weights | None:
        # microbatch k of the window belongs to period T0 + k // m (T0 = the window's first version)
        version = max(st.window_version + k // self.period - self.delay, 0)
        if version == st.version:
            return None
        if version == st.version - 1 and self.shadow is not None:
            return self.shadow
        raise ConfigError(
            f"2bw: microbatch {k} needs weight version {version} but stage holds {st.version} and "
            f"{st.version - 1}; use at least as many microbatches as pipeline stages"
        )

    def forward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        return self._weights(st, k)

    def backward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        return self._weights(st, k)

    def before_update(self, st: AsyncStage) -> None:
        if not self.delay:
            return
        if self.shadow is None:
            self.shadow = [p.detach().clone() for p in st.live]
        else:
            for s, p in zip(self.shadow, st.live, strict=True):
                s.copy_(p)

    def copies(self) -> int:
        return 0 if self.shadow is None else 1

    def carried(self, st: AsyncStage) -> dict[str, Weights]:
        return {} if self.shadow is None else {"shadow": self.shadow}

    def restore(self, st: AsyncStage, carried: dict[str, Weights]) -> None:
        if "shadow" in carried:
            self.shadow = [t.clone() for t in carried["shadow"]]


class Predict(WeightPolicy):
    name = "predict"
    needs_gradient = True

    def __init__(self) -> None:
        self.buffer: Weights | None = None

    def forward_weights(self, st: AsyncStage, k: int) -> Weights | None:
        s = st.staleness.get(k, 0)
        if s == 0 or not st.last_grads:
            return None
        if self.buffer is None:
            self.buffer = [torch.empty_like(p) for p in st.live]
        targets = {p: b for p, b in zip(st.params, self.buffer, strict=True)}
        predict_into(targets, st.optimizer, st.last_grads, s, st.extra_directions)
        return self.buffer

    def copies(self) -> int:
        return 0 if self.buffer is None else 1

    def carried(self, st: AsyncStage) -> dict[str, Weights]:
        return {"gradient": [st.last_grads[p] for p in st.params]} if st.last_grads else {}

    def restore(self, st: AsyncStage, carried: dict[str, Weights]) -> None:
        if "gradient" in carried:
            st.last_grads = {p: g.clone() for p, g in zip(st.params, carried["gradient"], strict=True)}


class NesterovLookAhead(Stash):
    """Weight stashing (the backward uses its forward's version, as AsyncPP's runtime does) with the
    optimizer replaced by its Nesterov form (:data:`OPTIMIZER_RULES`)."""

    name = "nesterov"


def nesterov_optimizer(optimizer: torch.optim.Optimizer, momentum: float = 0.99) -> torch.optim.Optimizer:
    """The Nesterov look-ahead form of ``optimizer`` over the same parameter groups (lr, decay):

    * AdamW → NAdam (Dozat 2016; ``torch.optim.NAdam``) with decoupled decay, β₁ = ``momentum``
      (0.99 in AsyncPP's run script), the same β₂ and ε. NAdam's step uses the look-ahead first
      moment μ_{t+1}·m_t + (1 − μ_t)·g_t, μ_t = β₁(1 − ½·0.96^{tψ}), ψ = 0.004: with β₁ near 1 the
      update follows the slowly turning momentum, which a gradient τ updates old perturbs little.
    * SGD with momentum μ → the same μ with Nesterov's look-ahead, b' = μb + g, W ← W − lr(g + μb')
      (a larger μ would multiply SGD's effective step by (1 − μ)/(1 − μ_new)).
    * NAdam or Nesterov SGD: returned as is.
    """
    keep = ("params", "lr", "weight_decay")
    groups = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    first = optimizer.param_groups[0]
    if type(optimizer) is torch.optim.AdamW:
        return torch.optim.NAdam(
            groups,
            lr=first["lr"],
            betas=(momentum, first["betas"][1]),
            eps=first["eps"],
            decoupled_weight_decay=True,
            foreach=False,
        )
    if type(optimizer) is torch.optim.SGD and first["momentum"] > 0:
        if first["nesterov"]:
            return optimizer
        mu = first["momentum"]
        return torch.optim.SGD(groups, lr=first["lr"], momentum=mu, nesterov=True, foreach=False)
    if type(optimizer) is torch.optim.NAdam:
        return optimizer
    raise ConfigError(
        f"--weight-policy nesterov needs AdamW or SGD with momentum (got {type(optimizer).__name__}); "
        "use --optimizer adamw or sgd"
    )


#: policy → fn(optimizer) → the optimizer that policy steps with (policies not named keep theirs).
OPTIMIZER_RULES: Mapping[str, Callable[[torch.optim.Optimizer], torch.optim.Optimizer]] = MappingProxyType(
    {"nesterov": nesterov_optimizer}
)


def policy_optimizer(name: str, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer policy ``name`` updates with (``optimizer`` itself unless the policy has a rule)."""
    rule = OPTIMIZER_RULES.get(name)
    return optimizer if rule is None else rule(optimizer)


#: name → factory(period m, delay from the schedule, options) of a stage's policy.
POLICIES: Mapping[str, Callable[..., WeightPolicy]] = MappingProxyType(
    {
        "none": lambda m, delay, **o: WeightPolicy(),
        "stash": lambda m, delay, **o: Stash(),
        "2bw": lambda m, delay, **o: TwoBufferedWeights(m, delay),
        "predict": lambda m, delay, **o: Predict(),
        "dc": lambda m, delay, **o: DelayCompensated(o.get("dc_lambda", 2.0)),
        "nesterov": lambda m, delay, **o: NesterovLookAhead(),
    }
)


def make_policy(name: str, m: int, delay: int, **options: float) -> WeightPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown --weight-policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return factory(m, delay, **options)
