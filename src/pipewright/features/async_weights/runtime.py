"""Asynchronous pipeline execution: the executor's F, B/I and STEP handlers wrapped per stage.

The executor is not changed: :meth:`AsyncRuntime.handlers` returns ``{kind: fn(state, action)}`` that
call the executor's own handlers inside a weight context.

How a policy's weights reach the forward and the backward without copies into the live parameters:

* forward: the parameters' ``.data`` point at the policy's tensors (Ŵ for ``predict``, W_{t−1} for
  ``2bw``) while the default F handler runs, then back at the live tensors, which therefore stay
  bit-identical (no arithmetic touches them);
* backward: every tensor the forward saves for the backward is packed by a saved-tensor hook; a
  tensor that is (a view of) a weight is stored as (parameter, view geometry) and unpacked at backward
  time as that view of the weights the policy names for this microbatch: the forward's version
  (``stash``, ``dc``, ``2bw``) or the live weights as they are then (``none``, ``predict``, PipeOptim's
  choice). In-place optimizer updates between the two therefore never corrupt the backward.

STEP(s, k): the gradients of stage s are averaged over the data-parallel group (before the update,
so replicas stay equal), rescaled from the executor's 1/M loss scale to the mean over the
microbatches of this update, clipped to the stage's own norm (stages update at different times, so no
global norm exists), and the stage's optimizer steps with the learning rate ``lr_fn(k)``.

Non-finite gradients (``on_nonfinite``, as ``pipewright train --on-nonfinite``): checked per stage after
the dp average (so every replica decides alike) and before the update. ``skip`` leaves the weights and
the optimizer state as they are for that update (the policy's bookkeeping still counts it, so weight
versions stay aligned) and records a one-line message; ``stop`` raises
:class:`~pipewright.runtime.reliability.nonfinite.NonFiniteError` naming the step, the stage and the
parameter.
There is no cross-stage agreement: asynchronous stages have no common step to skip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipewright.features.async_weights.directions import DirectionFn
from pipewright.features.async_weights.policies import WeightPolicy, make_policy, policy_optimizer
from pipewright.features.async_weights.staleness import check_async
from pipewright.ir import REDUCE_GRAD, STEP, Action, B, F, I, Schedule, W
from pipewright.optim import clip_grad_norm_, set_lr
from pipewright.runtime.reliability import nonfinite


class AsyncStage:
    """One stage's live weights, optimizer and weight policy."""

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: WeightPolicy,
        staleness: Mapping[int, int],
        *,
        extra_directions: Mapping[type, DirectionFn] | None = None,
    ) -> None:
        self.stage = stage
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.on_nonfinite: str | None = None  # None: no check; "stop" or "skip" (module doc)
        self.nonfinite: list[str] = []  # one line per skipped update
        self.live = [p.data for p in self.params]
        self.optimizer, self.policy = optimizer, policy
        self.staleness = dict(staleness)  # microbatch → updates between its F and its B
        self.extra_directions = extra_directions
        self.version = 0  # optimizer updates so far
        self.window_version = 0  # updates before the current window (windows drain completely)
        self.pending: list[int] = []  # microbatches whose gradients wait for the next update
        self.last_grads: dict[torch.Tensor, torch.Tensor] = {}
        self.peak_copies = 0

    # -- weight contexts ------------------------------------------------------------------------
    def _hooks(self, k: int, used: list[torch.Tensor]):
        index = {w.untyped_storage().data_ptr(): i for i, w in enumerate(used)}
        base = [w.storage_offset() for w in used]

        def pack(t: torch.Tensor) -> Any:
            i = index.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            if i is None:
                return t
            return (i, t.size(), t.stride(), t.storage_offset() - base[i], t.requires_grad)

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, torch.Tensor):
                return x
            i, size, stride, offset, _ = x
            target = self.policy.backward_weights(self, k) or self.live
            w = target[i]
            return w.as_strided(size, stride, w.storage_offset() + offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def forward(self, k: int, run: Callable[[], None]) -> None:
        weights = self.policy.forward_weights(self, k)
        used = self.live if weights is None else weights
        if weights is not None:
            for p, w in zip(self.params, weights, strict=True):
                p.data = w
        try:
            with self._hooks(k, used):
                run()
        finally:
            if weights is not None:
                for p, w in zip(self.params, self.live, strict=True):
                    p.data = w
        self.peak_copies = max(self.peak_copies, self.policy.copies())

    def backward(self, k: int, run: Callable[[], None], *, complete: bool = True) -> None:
        """B (``complete``: the weight gradient is in ``.grad`` now) or I (W completes it later)."""
        run()
        if complete:
            self.pending.append(k)
        self.policy.after_backward(self, k)

    # -- update ---------------------------------------------------------------------------------
    def ready(self) -> bool:
        period = self.policy.period
        return period is None or len(self.pending) >= period

    def _finite(self, step: int, rank: int) -> bool:
        """True when every gradient is finite; else skip (record) or stop, as ``on_nonfinite`` says."""
        stages = {self.stage: self.module}
        if self.on_nonfinite is None or not nonfinite.local_flag(stages):
            return True
        message = nonfinite.report(step, nonfinite.local_findings(stages, rank), self.on_nonfinite)
        if self.on_nonfinite == "stop":
            raise nonfinite.NonFiniteError(message)
        self.nonfinite.append(message.replace("the optimizer step", f"stage {self.stage}'s update"))
        return False

    def update(
        self,
        lr: float,
        grad_scale: float,
        clip: float,
        dp_group: Any = None,
        dp: int = 1,
        *,
        step: int = 0,
        rank: int = 0,
    ) -> None:
        """Average over dp, rescale, check finiteness (``step``, ``rank``: where a report says it was),
        clip (stage-local norm), adjust (policy), step, keep the gradient for the next prediction and
        clear ``.grad``."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        finite = self._finite(step, rank)
        if finite and clip > 0:
            clip_grad_norm_(self.params, clip)
        if finite:
            self.policy.adjust_grads(self, self.pending)
        self.policy.before_update(self)
        self.peak_copies = max(self.peak_copies, self.policy.copies())
        if finite:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.version += 1
        if finite and self.policy.needs_gradient:  # D(W) of the next prediction reads it
            self.last_grads = {p: p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        self.pending.clear()
        self.policy.after_update(self)


class AsyncRuntime:
    """The async stages of one pp rank and the handlers that run them inside the executor.

    ``schedule``: the asynchronous schedule the executor runs (its STEP actions define s).
    ``optimizers``: one per stage this rank holds. ``lr_fn(k)``: learning rate of the update made at
    microbatch k of the window. Each update uses the mean gradient of its microbatches: the executor
    scales each loss by 1/M (M microbatches in the window), the update multiplies by M/period.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        optimizers: Mapping[int, torch.optim.Optimizer],
        policy: str,
        *,
        period: int,
        lr_fn: Callable[[int], float],
        clip: float = 0.0,
        dp_group: Any = None,
        dp: int = 1,
        extra_directions: Mapping[type, DirectionFn] | None = None,
        on_nonfinite: str | None = None,
        step_of: Callable[[int], int] | None = None,
        rank: int = 0,
        **options: float,
    ) -> None:
        self.schedule = schedule
        self.step_of = step_of or (lambda k: 0)  # window microbatch → training step (reports)
        self.rank = rank
        self.lr_fn, self.clip, self.dp_group, self.dp = lr_fn, clip, dp_group, dp
        table = check_async(schedule)
        delay = 1 if any(table.values()) else 0
        self.policy_name = policy
        converted: dict[int, torch.optim.Optimizer] = {}  # one rule application per shared optimizer
        for o in optimizers.values():
            if id(o) not in converted:
                converted[id(o)] = policy_optimizer(policy, o)
        optimizers = {s: converted[id(o)] for s, o in optimizers.items()}
        self.stages = {
            s: AsyncStage(
                s,
                mod,
                optimizers[s],
                make_policy(policy, period, delay, **options),
                {k: v for (st, k), v in table.items() if st == s},
                extra_directions=extra_directions,
            )
            for s, mod in stages.items()
        }
        for st in self.stages.values():
            st.on_nonfinite = nonfinite.check_policy(on_nonfinite) if on_nonfinite else None
        self.period = period if self.stages[next(iter(self.stages))].policy.period else 1

    def set_schedule(self, schedule: Schedule) -> None:
        """Use another window (different microbatch count): new staleness per microbatch."""
        self.schedule = schedule
        table = check_async(schedule)
        for s, st in self.stages.items():
            st.staleness = {k: v for (stage, k), v in table.items() if stage == s}
            st.window_version = st.version

    def handlers(self, base: Mapping[str, Callable]) -> dict[str, Callable]:
        """Wrapped handlers for F, B, I, STEP (``base``: the executor's default handlers) and W when
        ``base`` has it: :meth:`wrap` applied to each."""
        kinds = (F, B, I, STEP, REDUCE_GRAD) + ((W,) if W in base else ())
        return {kind: self.wrap(kind, base.get(kind)) for kind in kinds}

    def wrap(self, kind: str, inner: Callable | None) -> Callable | None:
        """The executor's handler wrapper (``PipelineExecutor(handler_wrappers=[runtime.wrap])``): F, B
        and I run inside the stage's weight context, W records its microbatch, STEP makes the update;
        REDUCE_GRAD becomes a no-op (gradients are reduced at every STEP instead of once per window).
        Other kinds are left alone."""

        def forward(state: Any, a: Action) -> None:
            if not torch.is_grad_enabled():  # evaluation (forward only): the live weights, no policy
                inner(state, a)
                return
            self.stages[a.stage].forward(a.microbatch, lambda: inner(state, a))

        def backward(state: Any, a: Action) -> None:
            st = self.stages[a.stage]
            st.backward(a.microbatch, lambda: inner(state, a), complete=kind == B)

        def weight_grad(state: Any, a: Action) -> None:  # W: the deferred weight gradient lands
            inner(state, a)
            self.stages[a.stage].pending.append(a.microbatch)

        def step(state: Any, a: Action) -> None:
            st = self.stages[a.stage]
            if not st.ready():
                return
            m = self.schedule.num_microbatches
            # a shared optimizer steps every parameter with a gradient: hide the other stages' ones
            others = [p for o in self.stages.values() if o is not st for p in o.params]
            held = [p.grad for p in others]
            for p in others:
                p.grad = None
            try:
                st.update(
                    self.lr_fn(a.microbatch),
                    m / len(st.pending),
                    self.clip,
                    self.dp_group,
                    self.dp,
                    step=self.step_of(a.microbatch),
                    rank=self.rank,
                )
            finally:
                for p, g in zip(others, held, strict=True):
                    p.grad = g

        step.reduces_gradients = True  # type: ignore[attr-defined]  # over dp, before each update
        wrapped = {F: forward, B: backward, I: backward, W: weight_grad, STEP: step}
        if kind == REDUCE_GRAD:
            return lambda state, a: None
        return wrapped.get(kind, inner)

    #: the STEP this wrapper installs all-reduces over dp itself (the executor need not warn)
    wrap.reduces_gradients = True  # type: ignore[attr-defined]

    # -- checkpoints (runtime.checkpoint.ExtraState): what a policy carries from window to window --
    def extra_state(self) -> dict[str, torch.Tensor]:
        """Per stage s: ``async/s/version`` (updates so far), ``async/s/lr`` (the learning rates of the
        last update, which predict's next extrapolation reads) and the policy's tensors
        (:meth:`WeightPolicy.carried`: 2bw's previous weights, predict's last gradient) as
        ``async/s/<name>/<i>``; identical over dp replicas (DCP stores them once)."""
        out: dict[str, torch.Tensor] = {}
        for s, st in self.stages.items():
            out[f"async/{s}/version"] = torch.tensor(st.version)
            out[f"async/{s}/lr"] = torch.tensor(
                [g["lr"] for g in st.optimizer.param_groups], dtype=torch.float64
            )
            for name, tensors in st.policy.carried(st).items():
                out.update({f"async/{s}/{name}/{i}": t for i, t in enumerate(tensors)})
        return out

    def extra_wanted(self, stored: Mapping[str, tuple]) -> list[str]:
        """This rank's stages' keys, where the stored shapes are its parameters' (another layout or
        policy: none, and the policies start afresh)."""
        wanted = []
        for s, st in self.stages.items():
            shapes = [tuple(p.shape) for p in st.params]
            mine = {k: v for k, v in stored.items() if k.startswith(f"async/{s}/")}
            index = {k: int(k.rsplit("/", 1)[1]) for k in mine if k.count("/") == 3}
            if {f"async/{s}/version", f"async/{s}/lr"} <= set(mine) and all(
                i < len(shapes) and tuple(mine[k][0]) == shapes[i] for k, i in index.items()
            ):
                wanted += list(mine)
        return wanted

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        for s, st in self.stages.items():
            if f"async/{s}/version" not in state:
                continue
            st.version = st.window_version = int(state[f"async/{s}/version"])
            for group, lr in zip(st.optimizer.param_groups, state[f"async/{s}/lr"].tolist(), strict=True):
                group["lr"] = lr
            carried: dict[str, list[torch.Tensor]] = {}
            for key, t in sorted(state.items(), key=lambda kv: kv[0]):
                stage, name, i = key.split("/")[1:] if key.count("/") == 3 else (None, None, None)
                if stage == str(s):
                    carried.setdefault(name, [None] * len(st.params))[int(i)] = t
            st.policy.restore(st, carried)

    def weight_copies(self) -> dict[int, dict[str, int]]:
        """Per stage: weight versions held now and at peak (live included)."""
        return {
            s: {"now": 1 + st.policy.copies(), "peak": 1 + st.peak_copies} for s, st in self.stages.items()
        }
