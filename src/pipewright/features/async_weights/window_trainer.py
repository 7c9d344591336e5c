"""Training with an asynchronous schedule (``pipewright train --schedule async-1f1b --weight-policy P``).

The executor runs a *window* of ``--async-window`` training steps (M = window × m microbatches) as one
schedule without a flush: the pipeline fills and drains once per window, not per step. Every
microbatch's backward is followed by its stage's update (:mod:`.runtime`), so a step of m microbatches
makes m updates per stage (``2bw``: one, over the m accumulated gradients). The learning-rate schedule
runs over updates: update at global microbatch g uses lr_at(g) with warm-up ``warmup·m`` and length
``steps·m``, the same sequence a synchronous run with one microbatch per step and ``steps·m`` steps
sees; update g also reads that run's batch g (:meth:`AsyncPlugin._microbatches`). Windows end at
evaluation and checkpoint steps, so those see the weights of whole steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pipewright.errors import ConfigError
from pipewright.features.async_weights.options import AsyncOptions
from pipewright.features.async_weights.runtime import AsyncRuntime
from pipewright.optim import lr_at
from pipewright.options import section_of
from pipewright.runtime.core.executor import PipelineExecutor
from pipewright.runtime.core.plugin import ExecutorParts, OptimizerContext, TrainingPlugin
from pipewright.runtime.profiling.measured_timeline import gather_timeline
from pipewright.schedules import build_schedule


def check_config(config) -> None:
    """What an asynchronous run refuses (one-line ConfigErrors)."""
    from pipewright.features.async_weights.policies import POLICIES

    options = section_of(config, AsyncOptions)
    if options.weight_policy not in POLICIES:
        raise ConfigError(
            f"unknown --weight-policy {options.weight_policy!r}; choose one of: {', '.join(POLICIES)}"
        )
    if config.tp > 1:
        raise ConfigError("asynchronous schedules run without tensor parallelism; use --tp 1")
    if config.optimizer not in ("adamw", "sgd"):
        # the policies version and predict the stage parameters' plain optimizer updates; an optimizer
        # whose work runs inside the schedule (K-FAC) has no bubbles to fill here
        raise ConfigError(
            f"asynchronous schedules run with --optimizer adamw or sgd (got {config.optimizer}); "
            "K-FAC fills the bubbles of synchronous schedules"
        )
    # recomputation would rerun the forward on the live weights, not the policy's; the fp32 masters
    # and ZeRO shards are not the stage parameters the policies version
    for flag, value, plain in (
        ("--recompute", config.recompute, "none"),
        ("--precision", config.precision, "fp32"),
    ):
        if value != plain:
            raise ConfigError(f"asynchronous schedules run with {flag} {plain}; drop {flag}")
    for flag, on in (
        ("--shard-optimizer", config.shard_optimizer),
        ("--tie-embeddings", config.tie_embeddings),
    ):
        if on:
            raise ConfigError(f"asynchronous schedules do not support {flag} yet; drop it")
    if options.weight_policy == "2bw" and config.microbatches < config.pp:
        raise ConfigError(
            f"2bw accumulates over m ≥ p microbatches; raise --microbatches to {config.pp} or more"
        )


class AsyncPlugin(TrainingPlugin):
    """The feature's training plugin: it takes part in runs of schedules without a flush.

    optimizer: the weight policies' :class:`AsyncRuntime` over the finished stages and default
    optimizer; the optimizer becomes the one the policy steps with (nesterov: another update rule, so
    checkpoints save the one in use). Executor parts: the runtime's handler wrapper (F/B/I inside a
    weight context, STEP the update, which all-reduces over dp itself). Checkpoints carry the
    policies' state between windows (:meth:`AsyncRuntime.extra_state`); the plugin runs each step
    itself, a window of them at a time (see the module)."""

    @classmethod
    def active(cls, config: Any, schedule: Any) -> bool:
        return not schedule.meta.get("flush", True)

    @classmethod
    def check(cls, config: Any, schedule: Any, spec: Any) -> None:
        cp = config.cp
        if cp > 1:
            raise ConfigError(f"asynchronous schedules are not supported with --cp {cp} yet; use --cp 1")
        check_config(config)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.options = section_of(config, AsyncOptions)
        self._window_start = 0
        self._executors: dict[int, PipelineExecutor] = {}
        self._records: dict[int, dict] = {}
        self._preempted = False  # a SIGTERM reached some rank during the current window

    def optimizer(self, ctx: OptimizerContext) -> Any:
        c, b = self.config, ctx.build
        self.runtime = AsyncRuntime(
            b.schedule,
            dict(b.stages),
            dict.fromkeys(b.stages, ctx.optimizer),
            self.options.weight_policy,
            period=c.microbatches,
            lr_fn=self._lr,
            clip=c.grad_clip,
            dp_group=b.mesh.dp_group,
            dp=b.mesh.dp,
            on_nonfinite=c.on_nonfinite,
            step_of=lambda k: self._window_start + k // c.microbatches,
            rank=dist.get_rank() if dist.is_initialized() else 0,
        )
        return next(iter(self.runtime.stages.values())).optimizer

    def executor_parts(self, ctx: OptimizerContext) -> ExecutorParts:
        return ExecutorParts(handler_wrappers=(self.runtime.wrap,), step_reduces_gradients=True)

    def extra_state(self) -> AsyncRuntime:
        return self.runtime

    def _lr(self, k: int) -> float:
        """lr of the update made at window microbatch k: lr_at over updates (period P = 1, or m for
        2bw, whose updates then follow the synchronous run's per-step schedule)."""
        c = self.config
        per = c.microbatches // self.runtime.period  # updates per step
        g = (self._window_start * c.microbatches + k) // self.runtime.period
        return lr_at(g, lr=c.lr, warmup=c.warmup * per, total=c.steps * per, min_ratio=c.min_lr_ratio)

    def _executor(self, trainer: Any, steps: int) -> PipelineExecutor:
        c = self.config
        if steps not in self._executors:
            if steps == 1:
                self._executors[1] = trainer.executor
            else:
                from pipewright.schedules.async_variants import ASYNC_INTERLEAVED
                from pipewright.schedules.registry import default_registry

                # the asynchronous schedules (no flush: the ones this plugin runs): the library's and
                # the one this feature adds (feature.py)
                registry = default_registry().with_schedules(ASYNC_INTERLEAVED)
                sched = build_schedule(c.schedule, c.pp, steps * c.microbatches, c.virtual, registry=registry)
                self._executors[steps] = trainer.make_executor(sched)
        return self._executors[steps]

    def _window_end(self, step: int) -> int:
        c = self.config
        end = min(step + self.options.window, min(c.steps, c.stop_after) if c.stop_after else c.steps)
        for every in (c.eval_every, c.checkpoint_every):
            if every:
                end = min(end, (step // every + 1) * every)
        return end

    def train_step(self, trainer: Any, step: int) -> dict:
        """Step ``step``'s record, running the window that starts there first. Preemption: the ranks
        agree on a SIGTERM once per window, after it; the guard's ``stop_requested`` is set with the
        window's last record, when the weights are those of a whole step (the run then checkpoints
        the window's end and stops)."""
        if step not in self._records:
            self._run_window(trainer, step, self._window_end(step))
        record = self._records.pop(step)
        if not self._records and self._preempted:
            trainer.guard.stop_requested = True
        return record

    def _microbatches(
        self, trainer: Any, first: int, last: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This replica's microbatches of updates [first, last): update g reads global batch g of
        b × dp sequences (rows [d·b, (d+1)·b) for replica d), the data of a synchronous run with one
        microbatch per step, so both see the same sequences in the same order."""
        c, d = self.config, trainer.mesh.dp_rank
        b = c.microbatch_size
        xs, ys = [], []
        for g in range(first, last):
            x, y = trainer.dataset.batch("train", g, b * c.dp, trainer.spec.seq_len, c.seed)
            xs.append(torch.from_numpy(x[d * b : (d + 1) * b]))
            ys.append(torch.from_numpy(y[d * b : (d + 1) * b]))
        return xs, ys

    def _run_window(self, trainer: Any, start: int, end: int) -> None:
        c, n, guard, device = self.config, end - start, trainer.guard, trainer.device
        ex = self._executor(trainer, n)
        self.runtime.set_schedule(ex.schedule)
        guard.follow(ex)
        self._window_start = start
        xs, ys = self._microbatches(trainer, start * c.microbatches, end * c.microbatches)
        with guard.iteration(start):  # a receive or collective timeout: every rank's position
            dist.barrier()
            t0 = time.perf_counter()
            losses = ex.run(
                [x.to(device) for x in xs] if trainer.first else None,
                [y.to(device) for y in ys] if trainer.last else None,
            )
        skipped = [line for st in self.runtime.stages.values() for line in st.nonfinite]
        for st in self.runtime.stages.values():
            st.nonfinite.clear()
        if skipped:
            guard.last_nonfinite = skipped[-1]
        per_step = (time.perf_counter() - t0) / n
        self._preempted = guard.preempted(end - 1)
        trainer.timeline = gather_timeline(ex.last_spans, trainer.mesh)
        versions = [None] * dist.get_world_size()
        dist.all_gather_object(versions, {s: v["peak"] for s, v in self.runtime.weight_copies().items()})
        held = {str(s): v for d in versions for s, v in d.items()}
        m = c.microbatches
        for i, step in enumerate(range(start, end)):
            mine = losses[i * m : (i + 1) * m]
            self._records[step] = {
                "step": step,
                "loss": ex.global_loss(mine),
                "lr": self._lr((i + 1) * m - 1),
                "grad_norm": None,
                "step_time_s": per_step,
                "tokens_per_s": trainer.tokens_per_step / per_step,
                "bubble_fraction": trainer.timeline.bubble_fraction()
                if trainer.timeline is not None
                else None,
                "weight_policy": self.options.weight_policy,
                "weight_versions": held,
                **({"nonfinite": [x for x in skipped if x.startswith(f"step {step}:")]} if skipped else {}),
            }
