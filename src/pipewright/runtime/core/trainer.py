"""The Trainer: one process's share of a pipeline-parallel training run and its step loop.

The composition root (:mod:`pipewright.training`) prepares a :class:`PreparedRun` in the launching
process and starts the workers; each builds a :class:`Trainer` and calls :meth:`Trainer.train_step`:

1. the (dp, pp, tp) mesh, the rank's stages (only their layers); the plugins' build calls
   (:mod:`pipewright.runtime.core.plugin`: schedule rewrites, stage modules, extra parameters); the training
   options (recomputation, precision, ZeRO-1, …); the optimizer, then the plugins' optimizer calls;
   the executor with the plugins' executor parts (:meth:`Trainer.make_executor`);
2. per step k: the global batch = microbatch_size × microbatches × dp sequences of step k (a pure
   function of (seed, k), so every layout sees the same data), rows
   [d·m·b, (d+1)·m·b) for replica d, cut into m microbatches; ``executor.run`` runs the lowered
   schedule (forward, backward, gradient reduction over dp); with sequence parallelism, the replicated
   parameters' gradients summed over tp; global-norm clipping; optimizer step.

Loss convention: the loss of a step is the mean token cross-entropy over the global batch; each
microbatch's loss is scaled by 1/m before its backward (by the executor) and the data-parallel reduction
averages over replicas, so gradients do not depend on the layout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipewright.cost.placement import loss_stage
from pipewright.data import TokenDataset, open_dataset
from pipewright.errors import ConfigError
from pipewright.ir import Schedule
from pipewright.models.layout import Layout
from pipewright.models.spec import ModelSpec
from pipewright.optim import base_optimizer, build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.runtime.checkpointing.checkpoint import ExtraState, load_checkpoint, save_checkpoint
from pipewright.runtime.checkpointing.fingerprint import fingerprint
from pipewright.runtime.checkpointing.reshard import shard_layout
from pipewright.runtime.checkpointing.save_errors import with_policy
from pipewright.runtime.core.compile import compile_stages
from pipewright.runtime.core.executor import PipelineExecutor
from pipewright.runtime.core.plugin import (
    BuildContext,
    Built,
    ExecutorParts,
    OptimizerContext,
    TrainingPlugin,
    merge_built,
)
from pipewright.runtime.core.rank_stages import rank_stages
from pipewright.runtime.core.train_options import TrainingOptions
from pipewright.runtime.parallel.cp import ContextParallel
from pipewright.runtime.parallel.moe_parallel import MoeRuntime
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import (
    grad_norm_params,
    sharded_parameters,
    sync_sequence_parallel_grads,
)
from pipewright.runtime.profiling.measured_timeline import gather_timeline
from pipewright.runtime.reliability.guard import RunGuard
from pipewright.runtime.setup.config import TrainConfig
from pipewright.timeline import Timeline


@dataclass(frozen=True)
class PreparedRun:
    """Everything the workers need, checked and resolved (picklable)."""

    config: TrainConfig
    spec: ModelSpec
    schedule: Schedule
    layout: Layout
    out_dir: Path
    fingerprint: str
    resume_from: Path | None = None
    start_step: int = 0
    meta: dict = field(default_factory=dict)
    # the training plugins' classes (pipewright.runtime.core.plugin), active for this run, in order
    plugins: tuple[type[TrainingPlugin], ...] = ()
    # flat names of the feature options that change the optimizer's update rule (checkpoint checks)
    update_settings: tuple[str, ...] = ()
    # a model of its own (pipewright.models.layer_list.LayerList): stages, loss, boundary shapes and
    # data come from it; None: the family's stages on the token data
    model: Any = None


@dataclass(frozen=True)
class TrainResult:
    """What rank 0 returns: the per-step losses, the run folder and its files."""

    losses: list[float]
    val_losses: dict[int, float]
    out_dir: Path
    files: dict[str, Path]
    wall_s: float
    tokens_per_s: float
    preempted_at: int | None = None  # steps done when a SIGTERM stopped the run (checkpoint written)


def local_batches(
    run: PreparedRun, dataset: TokenDataset, split: str, step: int, dp_rank: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This replica's m microbatches of global batch ``step``: rows [d·m·b, (d+1)·m·b) of the
    microbatch_size × microbatches × dp sequences, cut into m (inputs, targets) int64 tensors."""
    c = run.config
    b, m = c.microbatch_size, c.microbatches
    inputs, targets = dataset.batch(split, step, c.global_batch, run.spec.seq_len, c.seed)
    rows = slice(dp_rank * m * b, (dp_rank + 1) * m * b)
    return list(torch.from_numpy(inputs[rows]).split(b)), list(torch.from_numpy(targets[rows]).split(b))


class Trainer:
    """One process's share of a training run: its stages, optimizer and pipeline executor.

    Collective: construct and call :meth:`train_step`, :meth:`evaluate`, :meth:`save` on every rank.
    ``mesh`` defaults to a new (dp, pp, tp) mesh over the default process group. ``plugins``: the
    training plugins' classes (default: ``run.plugins``), each made once per trainer from the config.
    """

    def __init__(
        self,
        run: PreparedRun,
        *,
        mesh: ParallelMesh | None = None,
        plugins: Sequence[type[TrainingPlugin]] | None = None,
    ) -> None:
        c, spec = run.config, run.spec
        self.run, self.config, self.spec = run, c, spec
        self.mesh = mesh or ParallelMesh.build(
            dp=c.dp, pp=c.pp, tp=c.tp, placement=c.placement_ranks(), ep=c.ep, cp=c.cp
        )
        self.device = self.mesh.device
        own = run.model  # a model given as a list of layers, or None
        self.dataset = own if own is not None else open_dataset(c.data, tokenizer=c.tokenizer, progress=False)
        self.plugins = [cls(c) for cls in (run.plugins if plugins is None else plugins)]
        mine = rank_stages(run, self.mesh)
        self.loss_fn, self.boundary_shape = mine.loss_fn, mine.boundary_shape
        self.sequence_parallel = mine.sequence_parallel
        self.context = ContextParallel.of(self.mesh, spec.seq_len, mine.stages)  # None when cp = 1
        self.built, ctx = self._build(run.schedule, mine.stages)  # the plugins' build calls (collective)
        self.schedule, self.stages = ctx.schedule, dict(ctx.stages)
        # recomputation, tied embeddings, --init-from, mixed precision, ZeRO-1 (runtime/core/train_options.py)
        self.options = TrainingOptions(c, spec, self.mesh, self.schedule, self.stages)
        if c.compile:  # torch.compile per stage, after recomputation wrapped its layers
            compile_stages(self.stages)
        self._parameters()
        self._optimizer()
        self.executor_parts = self._optimizer_and_parts(ctx)
        self.guard = RunGuard(
            self.mesh,
            self.stages,
            out_dir=run.out_dir,
            on_nonfinite=c.on_nonfinite,
            keep_checkpoints=c.keep_checkpoints,
            check_gradients=c.precision != "fp16",  # fp16: the loss scaler handles overflowed gradients
            collective_timeout_s=c.collective_timeout_s,
            steps=(min(c.steps, c.stop_after) if c.stop_after else c.steps) - run.start_step,
        )
        self.executor = self.make_executor(self.schedule)
        self.first = 0 in self.stages or self.built.batch_everywhere
        self.last = self.schedule.num_stages - 1 in self.stages or self.built.batch_everywhere
        self.timeline: Timeline | None = None
        self._checkpoint_names()

    def _parameters(self) -> None:
        """This rank's parameters by name (the stages' and the plugins' extra ones), and those counted in
        the global gradient norm: shards, replicated ones on tp rank 0, each parameter once (a module
        shared by two local stages), copies on other ranks not at all; under ep the experts' share."""
        self.params = {n: p for mod in self.stages.values() for n, p in mod.named_parameters()}
        self.params |= self.built.parameters
        self.norm_params = self.options.norm_params(
            [p for mod in self.stages.values() for p in grad_norm_params(mod, self.mesh.tp_group)]
            + list(self.built.parameters.values())
        )
        self.norm_params = list(
            {id(p): p for p in self.norm_params if not getattr(p, "counted_elsewhere", False)}.values()
        )
        # mixture of experts: aux-loss scale and report
        spec = self.spec
        self.moe = MoeRuntime(spec, self.mesh, self.stages, self.config.microbatches) if spec.is_moe else None
        if self.moe is not None:
            self.norm_params = self.moe.norm_params(self.norm_params)

    def _optimizer(self) -> None:
        """The optimizer over :attr:`params`: on fp32 masters (maybe sharded over dp) for a bf16/fp16
        model, else the configured one on the parameters themselves."""
        c = self.config
        self.master = None if self.options.plain else self.options.build_optimizer(self.params)
        if self.master is not None:
            self.optimizer = self.master.optimizer
        else:
            self.optimizer = build_optimizer(
                base_optimizer(c.optimizer), self.params.items(), lr=c.lr, weight_decay=c.weight_decay
            )

    def _checkpoint_names(self) -> None:
        """The checkpoint's names of this rank's state (a tensor-parallel shard is named with its tp
        rank) and the meta that lets a resume at another tp size rebuild the shards
        (runtime/checkpointing/reshard.py)."""
        run, c = self.run, self.config
        self.meta = {"fingerprint": run.fingerprint, "model": self.spec.name, "config": c.flat()}
        sharded = {id(p) for mod in self.stages.values() for p in sharded_parameters(mod)}
        suffix = f"#tp{self.mesh.tp_rank}of{self.mesh.tp}"
        state = self.master.named_state() if self.master is not None else self.params
        self.named_shards = {
            n + (suffix if n in self.params and id(self.params[n]) in sharded else ""): p
            for n, p in state.items()
        }
        self.model_fingerprint = fingerprint(self.spec, c.tokenizer)
        self.meta |= {
            "model_fingerprint": self.model_fingerprint,
            "tp_shards": shard_layout(self.stages.values(), sharded),
        }

    def _build(self, schedule: Schedule, stages: dict) -> tuple[Built, BuildContext]:
        """The plugins' build calls in order, each on the previous one's schedule and stages."""
        built = Built()
        ctx = BuildContext(self.run, self.mesh, self.device, schedule, stages, self.boundary_shape)
        for plugin in self.plugins:
            mine = plugin.build(ctx)
            built = merge_built(built, mine)
            ctx = BuildContext(
                self.run,
                self.mesh,
                self.device,
                mine.schedule if mine.schedule is not None else ctx.schedule,
                dict(mine.stages) if mine.stages is not None else ctx.stages,
                self.boundary_shape,
            )
        return built, ctx

    def _optimizer_and_parts(self, ctx: BuildContext) -> ExecutorParts:
        """The plugins' optimizer calls (each may wrap or replace the optimizer), then their
        executor parts, all on the finished build."""
        for plugin in self.plugins:
            octx = OptimizerContext(ctx, self.params, self.optimizer, self.master, self.options)
            self.optimizer = plugin.optimizer(octx)
        octx = OptimizerContext(ctx, self.params, self.optimizer, self.master, self.options)
        parts = ExecutorParts(handlers=self.options.handlers())
        for plugin in self.plugins:
            parts = parts.merged(plugin.executor_parts(octx))
        return parts

    def make_executor(self, schedule: Schedule) -> PipelineExecutor:
        """The one executor factory: ``schedule`` run on this rank's stages with the training options'
        and the plugins' parts, watched by the run guard (positions, injected faults, timeouts)."""
        c = self.config
        executor = PipelineExecutor(
            schedule,
            self.mesh,
            self.stages,
            loss_fn=None if self.built.computes_loss else self.options.loss_fn(self.loss_fn),
            boundary_shape=self.boundary_shape,
            dtype=self.options.dtype,
            device=self.device,
            recv_timeout_s=c.recv_timeout_s,
            record=True,
            scatter_gather=c.scatter_gather,
            loss_stage=loss_stage(self.run.layout, self.schedule.num_stages),
            **self.executor_parts.executor_kwargs(),  # handler wrappers: before the guard's
        )
        if self.context is not None:  # DualPipe's F&B pairs overlapped (runtime/parallel/cp/overlap.py)
            self.context.overlap(executor, c, self.mesh)
        elif self.moe is not None:  # the same for the experts' all-to-alls (runtime/parallel/moe_parallel.py)
            self.moe.overlap(executor, c)
        self.guard.attach(executor)  # wraps its handlers: each rank's position, injected faults
        return executor

    @property
    def extra_state(self) -> ExtraState | None:
        """State beyond the parameters and the optimizer's that checkpoints carry: a plugin's (None:
        the optimizer's own :class:`~pipewright.runtime.checkpointing.checkpoint.ExtraState`, if any)."""
        states = [s for s in (p.extra_state() for p in self.plugins) if s is not None]
        if len(states) > 1:
            raise ConfigError("two features both add checkpoint state; enable only one")
        return states[0] if states else None

    @property
    def tokens_per_step(self) -> int:
        return self.config.global_batch * self.spec.seq_len

    def update_settings(self) -> dict[str, object]:
        """The settings that choose the update rule: the optimizer and the features' options that do."""
        flat = self.meta["config"]
        return {k: flat[k] for k in ("optimizer", *self.run.update_settings) if k in flat}

    def load(self, path: Path) -> int:
        """Load a checkpoint; returns its step (the number of steps done)."""
        meta = load_checkpoint(
            path,
            self.named_shards,
            self.optimizer,
            fingerprint=self.run.fingerprint,
            model_fingerprint=self.model_fingerprint,
            tp_shards=self.meta["tp_shards"],
            settings=self.update_settings(),
            extra=self.extra_state,
        )
        if self.master is not None:
            self.master.after_load()
        scaler = self.options.scaler
        if scaler is not None and "loss_scaler" in meta:  # fp16: continue with the saved scale
            scaler.load_state(meta["loss_scaler"])
        return int(meta["step"])

    def save(self, done: int) -> Path | None:
        """Checkpoint after ``done`` steps (collective); a stalled save is reported by the guard."""
        scaler = self.options.scaler
        meta = self.meta if scaler is None else {**self.meta, "loss_scaler": scaler.state()}
        folder = self.run.out_dir / "checkpoints"

        def save() -> Path:
            with self.guard.saving(done) as options:
                return save_checkpoint(
                    folder,
                    done,
                    self.named_shards,
                    self.optimizer,
                    meta=meta,
                    extra=self.extra_state,
                    **options,
                )

        return with_policy(save, self.config.on_save_error, f"step {done}")  # --on-save-error

    def forward_backward(self, step: int) -> float:
        """Zero the gradients and run the schedule on global batch ``step``; gradients end up reduced
        over dp. Returns the mean loss over the global batch (on every rank)."""
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)
        for prm in self.built.parameters.values():
            prm.grad = None
        xs, ys = self._batches("train", step)
        if self.moe is not None:
            self.moe.before_run(self.options.loss_scale)
        losses = self.executor.run(
            [x.to(self.device) for x in xs] if self.first else None,
            [y.to(self.device) for y in ys] if self.last else None,
        )
        for plugin in self.plugins:  # e.g. complete a feature's collectives, reduce over dp
            plugin.after_run()
        if self.sequence_parallel:  # replicated parameters saw 1/t of the tokens: sum over tp
            for mod in self.stages.values():
                sync_sequence_parallel_grads(mod, self.mesh.tp_group)
        if self.context is not None:  # each cp rank saw 1/cp of the tokens: average over cp
            self.context.sync_grads(self.stages.values(), reduced=self.options.reduces_over_cp)
        self.options.after_backward()
        return self._global_loss(losses) / self.options.loss_scale

    def _batches(self, split: str, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This replica's microbatches, cut to this cp rank's positions under context parallelism."""
        xs, ys = local_batches(self.run, self.dataset, split, step, self.mesh.dp_rank)
        if self.context is not None:
            xs, ys = self.context.shard(xs), self.context.shard(ys)
        return xs, ys

    def _global_loss(self, losses: list[float]) -> float:
        """The executor's mean over pp and dp, then over the cp ranks (equal token counts)."""
        loss = self.executor.global_loss(losses)
        return loss if self.context is None else self.context.mean(loss, self.device)

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Clip to the global gradient norm, set the step's learning rate, step. Returns (lr, norm)."""
        c = self.config
        lr = lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio)
        set_lr(self.optimizer, lr)
        groups = [self.mesh.tp_group, self.mesh.pp_group]
        if self.moe is not None:  # expert parallelism: experts differ over dp, so their norm sums over it
            groups = self.moe.norm_groups(groups)
        if self.master is not None:
            return lr, self.options.step(self.norm_params, groups, c.grad_clip)
        norm = clip_grad_norm_(list(self.params.values()), c.grad_clip, groups, norm_params=self.norm_params)
        self.optimizer.step()
        return lr, norm

    def train_step(self, step: int) -> dict:
        """One training step; returns its metrics record (the same on every rank, bar timing). A
        plugin that runs the step itself (asynchronous windows) does it here."""
        for plugin in self.plugins:
            record = plugin.train_step(self, step)
            if record is not None:
                return record
        with self.guard.iteration(step):  # a receive or collective timeout: a hang report of every rank
            dist.barrier()
            t0 = time.perf_counter()
            loss = self.forward_backward(step)
            skipped = not self.guard.before_optimizer(step, loss)  # NaN/inf anywhere; SIGTERM pending
            if skipped:
                c = self.config
                lr = lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio)
                norm = None
            else:
                lr, norm = self.optimizer_step(step)
        step_time = time.perf_counter() - t0
        self.timeline = gather_timeline(self.executor.last_spans, self.mesh)
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "bubble_fraction": self.timeline.bubble_fraction() if self.timeline is not None else None,
            **(self.moe.report() if self.moe is not None else {}),
            **({"skipped": True} if skipped else {}),
        }

    def evaluate(self, done: int = 0) -> float:
        """Validation loss: mean token cross-entropy over ``eval_batches`` fixed global batches of the
        held-out split, each run forward-only through the schedule (:meth:`PipelineExecutor.evaluate`).
        ``done``: the steps done (a stalled evaluation is reported by the guard as after it)."""
        losses: list[float] = []

        def evaluate(executor: PipelineExecutor, xs: Any, ys: Any) -> list[float]:
            for plugin in self.plugins:  # a plugin with its own validation pass (vocabulary passes)
                out = plugin.evaluate(executor, xs, ys)
                if out is not None:
                    return out
            return executor.evaluate(xs, ys)

        with self.guard.evaluation(done):
            for j in range(self.config.eval_batches):
                xs, ys = self._batches("val", j)
                losses += evaluate(
                    self.executor,
                    [x.to(self.device) for x in xs] if self.first else None,
                    [y.to(self.device) for y in ys] if self.last else None,
                )
            return self._global_loss(losses)
