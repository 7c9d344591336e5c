"""The training loop: one pipeline-parallel GPT trained on torch.distributed.

:func:`prepare` runs in the launching process and checks everything it can before any worker starts
(config, data file, schedule arguments, layout vs. world size, checkpoint fingerprint). :func:`train`
then starts the workers (or, under torchrun, runs in torchrun's process); each runs
:func:`train_worker`:

1. build the (dp, pp, tp) mesh, the rank's stages (only their layers), the optimizer;
2. per step k: the global batch = microbatch_size × microbatches × dp sequences of step k (a pure
   function of (seed, k), so every layout sees the same data), rows
   [d·m·b, (d+1)·m·b) for replica d, cut into m microbatches; ``executor.run`` runs the lowered
   schedule (forward, backward, gradient reduction over dp); with sequence parallelism, the replicated
   parameters' gradients summed over tp; global-norm clipping; optimizer step;
3. rank 0 appends one JSON object per step to ``out/metrics.jsonl`` and at the end draws
   ``loss.png``, ``timeline.png`` (the measured timeline of the last step) and ``trace.json``.

Loss convention: the loss of a step is the mean token cross-entropy over the global batch; each
microbatch's loss is scaled by 1/m before its backward (by the executor) and the data-parallel reduction
averages over replicas, so gradients do not depend on the layout.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from pipewright.codec import load_csv
from pipewright.cost.placement import loss_stage
from pipewright.data import TokenDataset, open_dataset
from pipewright.errors import ConfigError
from pipewright.features import (
    check_training,
    library_schedules,
    optimizer_hook,
    training_hook,
    training_parts,
)
from pipewright.ir import Schedule
from pipewright.models.family import build_stage
from pipewright.models.gpt import loss_fn
from pipewright.models.layout import Layout, resolve_layout
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import linear_factory_for
from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.passes import validate
from pipewright.runtime import elastic
from pipewright.runtime.checkpoint import (
    ExtraState,
    load_checkpoint,
    read_meta,
    resumable_checkpoint,
    same_model,
    save_checkpoint,
)
from pipewright.runtime.config import TrainConfig, fingerprint
from pipewright.runtime.executor import PipelineExecutor
from pipewright.runtime.guard import RunGuard
from pipewright.runtime.launch import default_backend, init_from_env, running_under_torchrun, spawn
from pipewright.runtime.mesh import ParallelMesh
from pipewright.runtime.progress_log import progress, strict_json
from pipewright.runtime.reshard import shard_layout
from pipewright.runtime.resume_check import model_difference
from pipewright.runtime.run_folder import RunLock, check_out, claim, no_checkpoint_advice
from pipewright.runtime.save_errors import with_policy
from pipewright.runtime.size_check import check_fits
from pipewright.runtime.timeline import gather_timeline
from pipewright.runtime.tp import (
    grad_norm_params,
    sharded_parameters,
    sync_sequence_parallel_grads,
    tp_linear_factory,
)
from pipewright.runtime.train_options import TrainingOptions
from pipewright.schedules import build_schedule
from pipewright.timeline import Timeline
from pipewright.viz.loss import plot_loss
from pipewright.viz.timeline import draw_timeline
from pipewright.viz.trace import write_trace

log = logging.getLogger(__name__)


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


def resolve_schedule(config: TrainConfig) -> Schedule:
    """Compute-only schedule for the config: a registry name or a PyTorch-format CSV path."""
    name = config.schedule
    if name.endswith(".csv"):
        sched = load_csv(name)
        if sched.lowered:
            from pipewright.passes.lower import strip_comms

            sched = strip_comms(sched)
        if sched.num_ranks != config.pp:
            raise ConfigError(f"schedule {name} has {sched.num_ranks} ranks but --pp is {config.pp}")
        if sched.num_microbatches != config.microbatches:
            raise ConfigError(
                f"schedule {name} has {sched.num_microbatches} microbatches but --microbatches is "
                f"{config.microbatches}"
            )
        if config.virtual is not None and sched.num_stages != config.pp * config.virtual:
            raise ConfigError(f"schedule {name} has {sched.num_stages} stages, not pp × virtual")
        return validate(sched)
    library = library_schedules()  # the schedule families and the features' schedules
    sched = validate(build_schedule(name, config.pp, config.microbatches, config.virtual, registry=library))
    hook = training_hook(sched)  # a feature that owns this schedule's loop (asynchronous weights)
    if hook is not None:
        hook.check_config(config)
    return sched


def default_out_dir(root: str | Path = "runs") -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    n = 1
    while path.exists():
        path = Path(root) / f"{stamp}-{n}"
        n += 1
    return path


def prepare(config: TrainConfig, *, world_size: int | None = None) -> PreparedRun:
    """Check the config, data, schedule, layout and resume point; choose the output folder."""
    config.check()
    if world_size is not None and world_size != config.world_size:
        raise ConfigError(
            f"tp × pp × dp = {config.tp}×{config.pp}×{config.dp} = {config.world_size} but there are "
            f"{world_size} processes; make the product equal the process count"
        )
    if config.data is not None and not Path(config.data).exists():
        raise ConfigError(f"data file {config.data} does not exist; give an existing --data path or omit it")
    schedule = resolve_schedule(config)
    layout = resolve_layout(config.layout, config.num_layers(), schedule.num_stages)  # before the (slow) data
    dataset = open_dataset(config.data, tokenizer=config.tokenizer, progress=config.progress)
    spec = config.model_spec(dataset.vocab_size)
    check_training(config, spec, schedule)  # the features' unsupported combinations (--vocab-parallel …)
    fp = fingerprint(spec, config.tokenizer, config.tp)
    out_dir = Path(config.out) if config.out else default_out_dir()
    if config.out:  # another run's folder, or one held by a live run: refused (runtime/run_folder.py)
        check_out(out_dir, resume=config.resume, overwrite=config.overwrite)
    resume_from, start = None, 0
    if config.resume:
        resume_from, warnings = resumable_checkpoint(out_dir / "checkpoints")
        for warning in warnings:  # a corrupted or truncated newest checkpoint: the previous one is used
            log.warning("%s", warning)
        if resume_from is None:
            raise ConfigError(no_checkpoint_advice(out_dir, warnings))
        meta = read_meta(resume_from)
        if not same_model(meta, fp, fingerprint(spec, config.tokenizer)):  # tp may differ: resharded
            differs = model_difference(meta, spec, config.tp)  # runtime/resume_check.py
            raise ConfigError(
                f"--resume: checkpoint {resume_from} belongs to another model ({meta.get('model', '?')}"
                + (f"; saved with {differs}" if differs else "")
                + "); use the same model dimensions and --tp, or a new --out"
            )
        start = int(meta["step"])
        if start >= config.steps:
            raise ConfigError(f"--resume: the checkpoint is at step {start}, --steps is {config.steps}")
    run = PreparedRun(config, spec, schedule, layout, out_dir, fp, resume_from, start)
    check_fits(run, cpu=default_backend() == "gloo" and world_size is None)  # runtime/size_check.py
    return run


def train(config: TrainConfig) -> TrainResult:
    """Prepare, then run the workers: torchrun's processes when launched by torchrun, else
    tp × pp × dp local processes (one CPU thread each). Returns rank 0's result (others: None under
    torchrun)."""
    if running_under_torchrun():
        init_from_env(cpu_allocator=config.cpu_allocator)
        run = prepare(elastic.auto_resume(config), world_size=int(os.environ["WORLD_SIZE"]))
        lock = _claim(run) if dist.get_rank() == 0 else None
        chosen = [str(run.out_dir) if lock is None else str(lock.folder)]  # rank 0's folder
        dist.broadcast_object_list(chosen, src=0)
        run = replace(run, out_dir=Path(chosen[0]))
        with lock or nullcontext():
            return train_worker(dist.get_rank(), run)
    run = prepare(config)
    lock = _claim(run)
    run = replace(run, out_dir=lock.folder)
    if config.out is None:
        _point_latest(run.out_dir)
    with lock:
        return _train_local(config, run)


def _claim(run: PreparedRun) -> RunLock:
    """The run folder, locked for the run's life (a new default folder; an old run moved aside)."""
    c = run.config
    given = Path(c.out) if c.out else None
    return claim(given, run.out_dir.parent, resume=c.resume, overwrite=c.overwrite)[1]


def _train_local(config: TrainConfig, run: PreparedRun) -> TrainResult:
    prepared = [run]

    def attempt(c: TrainConfig) -> TrainResult:
        again = prepared.pop() if prepared else prepare(c)  # a restart resumes from the newest checkpoint
        return spawn(
            train_worker,
            c.world_size,
            (again,),
            timeout_s=7 * 24 * 3600,
            forward_sigterm=True,
            cpu_allocator=c.cpu_allocator,
        )[0]

    if not config.max_restarts:
        return attempt(config)
    return elastic.run_with_restarts(config, run.out_dir, attempt, config.max_restarts)


def _point_latest(out_dir: Path) -> None:
    """Make ``runs/latest`` a symbolic link to the new default output folder (replaced atomically)."""
    link, tmp = out_dir.parent / "latest", out_dir.parent / ".latest.tmp"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out_dir.name)
        os.replace(tmp, link)
    except OSError as exc:  # e.g. no symbolic links on this filesystem: not worth failing the run
        log.warning("could not point %s at %s: %s", link, out_dir, exc)


# ---------------------------------------------------------------------------------------------- worker


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
    ``mesh`` defaults to a new (dp, pp, tp) mesh over the default process group.
    """

    def __init__(self, run: PreparedRun, *, mesh: ParallelMesh | None = None) -> None:
        c, spec = run.config, run.spec
        self.run, self.config, self.spec = run, c, spec
        self.mesh = mesh or ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp, placement=c.placement_ranks())
        self.device = self.mesh.device
        self.dataset = open_dataset(c.data, tokenizer=c.tokenizer, progress=False)
        self.schedule = run.schedule
        factory, self.loss_fn = linear_factory_for(run.schedule), loss_fn
        self.sequence_parallel = c.sequence_parallel and self.mesh.tp > 1
        if self.mesh.tp > 1:  # Megatron's column/row-parallel linears, vocabulary-parallel embedding and loss
            factory = tp_linear_factory(
                self.mesh.tp_group, sequence_parallel=self.sequence_parallel, num_heads=spec.heads
            )
            self.loss_fn = factory.cross_entropy
        # tensor entering a stage: [b, s, h], or this tp rank's [b, s/t, h] under sequence parallelism
        seq = spec.seq_len // self.mesh.tp if self.sequence_parallel else spec.seq_len
        self.boundary_shape = (c.microbatch_size, seq, spec.hidden)
        self.stages = {
            s: build_stage(spec, run.layout, s, seed=c.seed, linear_factory=factory).to(self.device)
            for s in self.schedule.stages_of(self.mesh.pp_rank)
        }
        # what the enabled features change: schedule, stage modules, extra parameters, handlers and their
        # wrappers (collective)
        self.parts = training_parts(self)
        if self.parts.schedule is not None:
            self.schedule = self.parts.schedule
        if self.parts.stages is not None:
            self.stages = dict(self.parts.stages)
        # recomputation, tied embeddings, --init-from, mixed precision, ZeRO-1 (runtime/train_options.py)
        self.options = TrainingOptions(c, spec, self.mesh, self.schedule, self.stages)
        self.params = {n: p for mod in self.stages.values() for n, p in mod.named_parameters()}
        self.params |= self.parts.parameters
        # parameters counted in the global gradient norm: shards, and replicated ones on tp rank 0
        self.norm_params = self.options.norm_params(
            [p for mod in self.stages.values() for p in grad_norm_params(mod, self.mesh.tp_group)]
            + list(self.parts.parameters.values())
        )
        self.master = None if self.options.plain else self.options.build_optimizer(self.params)
        if self.master is not None:  # fp32 masters (maybe sharded over dp) for a bf16/fp16 model
            self.optimizer = self.master.optimizer
        else:
            self.optimizer = build_optimizer(
                c.optimizer, self.params.items(), lr=c.lr, weight_decay=c.weight_decay
            )
        exec_schedule, handlers = self.schedule, {**self.options.handlers(), **self.parts.handlers}
        attach = optimizer_hook(c.optimizer)  # an optimizer whose work runs inside the schedule (K-FAC)
        if attach is not None:
            self.optimizer, extra, exec_schedule = attach(self)
            handlers = {**handlers, **extra}
        self.guard = RunGuard(
            self.mesh,
            self.stages,
            out_dir=run.out_dir,
            on_nonfinite=c.on_nonfinite,
            keep_checkpoints=c.keep_checkpoints,
            check_gradients=c.precision != "fp16",  # fp16: the loss scaler handles overflowed gradients
            collective_timeout_s=c.collective_timeout_s,
        )
        self.executor = PipelineExecutor(
            exec_schedule,
            self.mesh,
            self.stages,
            loss_fn=None if self.parts.loss_fn_off else self.options.loss_fn(self.loss_fn),
            boundary_shape=self.boundary_shape,
            dtype=self.options.dtype,
            handlers=handlers,
            handler_wrappers=list(self.parts.handler_wrappers),  # before the guard's (it wraps them)
            output_hooks=dict(self.parts.output_hooks),
            tensor_specs=dict(self.parts.tensor_specs),
            groups=dict(self.parts.groups),
            device=self.device,
            recv_timeout_s=c.recv_timeout_s,
            record=True,
            scatter_gather=c.scatter_gather,
            loss_stage=loss_stage(run.layout, self.schedule.num_stages),
        )
        self.guard.attach(self.executor)  # wraps its handlers: each rank's position, injected faults
        self.first = 0 in self.stages or self.parts.batch_everywhere
        self.last = self.schedule.num_stages - 1 in self.stages or self.parts.batch_everywhere
        self.timeline: Timeline | None = None
        self.meta = {"fingerprint": run.fingerprint, "model": spec.name, "config": asdict(c)}
        # checkpoint names: a tensor-parallel shard is named with its tp rank
        sharded = {id(p) for mod in self.stages.values() for p in sharded_parameters(mod)}
        suffix = f"#tp{self.mesh.tp_rank}of{self.mesh.tp}"
        state = self.master.named_state() if self.master is not None else self.params
        self.named_shards = {
            n + (suffix if n in self.params and id(self.params[n]) in sharded else ""): p
            for n, p in state.items()
        }
        # what lets a resume at another tp size rebuild the shards (runtime/reshard.py)
        self.model_fingerprint = fingerprint(spec, c.tokenizer)
        self.meta |= {
            "model_fingerprint": self.model_fingerprint,
            "tp_shards": shard_layout(self.stages.values(), sharded),
        }

    @property
    def extra_state(self) -> ExtraState | None:
        """State beyond the parameters and the optimizer's that checkpoints carry (None: the
        optimizer's own :class:`~pipewright.runtime.checkpoint.ExtraState`, if any)."""
        return None

    @property
    def tokens_per_step(self) -> int:
        return self.config.global_batch * self.spec.seq_len

    def load(self, path: Path) -> int:
        """Load a checkpoint; returns its step (the number of steps done)."""
        meta = load_checkpoint(
            path,
            self.named_shards,
            self.optimizer,
            fingerprint=self.run.fingerprint,
            model_fingerprint=self.model_fingerprint,
            tp_shards=self.meta["tp_shards"],
            settings=self.meta["config"],
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
        for prm in self.parts.parameters.values():
            prm.grad = None
        xs, ys = local_batches(self.run, self.dataset, "train", step, self.mesh.dp_rank)
        losses = self.executor.run(
            [x.to(self.device) for x in xs] if self.first else None,
            [y.to(self.device) for y in ys] if self.last else None,
        )
        if self.parts.after_run is not None:  # e.g. complete a feature's collectives, reduce over dp
            self.parts.after_run()
        if self.sequence_parallel:  # replicated parameters saw 1/t of the tokens: sum over tp
            for mod in self.stages.values():
                sync_sequence_parallel_grads(mod, self.mesh.tp_group)
        self.options.after_backward()
        return self.executor.global_loss(losses) / self.options.loss_scale

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Clip to the global gradient norm, set the step's learning rate, step. Returns (lr, norm)."""
        c = self.config
        lr = lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio)
        set_lr(self.optimizer, lr)
        groups = [self.mesh.tp_group, self.mesh.pp_group]
        if self.master is not None:
            return lr, self.options.step(self.norm_params, groups, c.grad_clip)
        norm = clip_grad_norm_(list(self.params.values()), c.grad_clip, groups, norm_params=self.norm_params)
        self.optimizer.step()
        return lr, norm

    def train_step(self, step: int) -> dict:
        """One training step; returns its metrics record (the same on every rank, bar timing)."""
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
            **({"skipped": True} if skipped else {}),
        }

    def evaluate(self, done: int = 0) -> float:
        """Validation loss: mean token cross-entropy over ``eval_batches`` fixed global batches of the
        held-out split, each run forward-only through the schedule (:meth:`PipelineExecutor.evaluate`).
        ``done``: the steps done (a stalled evaluation is reported by the guard as after it)."""
        losses: list[float] = []
        evaluate = self.parts.evaluate or (lambda executor, xs, ys: executor.evaluate(xs, ys))
        with self.guard.evaluation(done):
            for j in range(self.config.eval_batches):
                xs, ys = local_batches(self.run, self.dataset, "val", j, self.mesh.dp_rank)
                losses += evaluate(
                    self.executor,
                    [x.to(self.device) for x in xs] if self.first else None,
                    [y.to(self.device) for y in ys] if self.last else None,
                )
            return self.executor.global_loss(losses)


def train_worker(rank: int, run: PreparedRun) -> TrainResult | None:
    """One process's training loop (see the module docstring). Collective: every rank runs it."""
    c = run.config
    torch.manual_seed(c.seed + rank)
    hook = training_hook(run.schedule)  # e.g. asynchronous schedules: weight policies
    trainer = Trainer(run) if hook is None else hook.trainer(run)
    start = trainer.load(run.resume_from) if run.resume_from is not None else 0
    if start:
        log.info("rank %d resumed from %s at step %d", rank, run.resume_from, start)
    writer = MetricsWriter(run, start, trainer.tokens_per_step) if rank == 0 else None
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    t_run = time.perf_counter()
    end = min(c.steps, c.stop_after) if c.stop_after else c.steps
    done = start
    for step in range(start, end):
        record = trainer.train_step(step)
        done = step + 1
        if c.eval_every and (done % c.eval_every == 0 or done == c.steps):
            record["val_loss"] = val_losses[step] = trainer.evaluate(done)
        losses.append(record["loss"])
        if writer is not None:
            writer.write(record)
        preempted = trainer.guard.stop_requested
        if (c.checkpoint_every and done % c.checkpoint_every == 0) or done == end or preempted:
            trainer.save(done)
        if preempted:  # SIGTERM: every rank finished this step and saved it (elastic.Preemption)
            log.warning("rank %d: preempted, stopping after step %d (checkpoint written)", rank, done)
            break
    trainer.guard.close()
    wall = time.perf_counter() - t_run
    if writer is None:
        return None
    writer.close()
    files = write_artifacts(run, trainer.timeline) if c.artifacts else {}
    files["metrics"] = writer.path
    rate = len(losses) * trainer.tokens_per_step / wall if wall > 0 else 0.0
    stopped = done if trainer.guard.stop_requested and done < end else None
    return TrainResult(losses, val_losses, run.out_dir, files, wall, rate, preempted_at=stopped)


class MetricsWriter:
    """Rank 0's ``metrics.jsonl`` (one JSON object per step) and progress bar."""

    def __init__(self, run: PreparedRun, start: int, tokens_per_step: int) -> None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = run.out_dir / "metrics.jsonl"
        kept: list[str] = []
        if start > 0 and self.path.is_file():  # resuming: keep the steps before the checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] < start]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        (run.out_dir / "config.json").write_text(json.dumps(asdict(run.config), indent=1, default=str))
        self.progress = None
        if run.config.progress:  # a bar on a terminal, plain lines in a log (runtime/progress_log.py)
            self.progress = progress(run.config.steps, start)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(strict_json(record) + "\n")  # NaN/inf as null
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            self.progress.update(1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def write_artifacts(run: PreparedRun, timeline: Timeline | None) -> dict[str, Path]:
    """loss.png from metrics.jsonl; timeline.png, trace.json and timeline.json (:meth:`Timeline.save`) from
    the last step's measured timeline."""
    out_dir = run.out_dir
    files = {"loss_png": out_dir / "loss.png"}
    plot_loss(out_dir / "metrics.jsonl", files["loss_png"])
    if timeline is not None:
        files["timeline_png"] = out_dir / "timeline.png"
        files["trace"] = out_dir / "trace.json"
        c = run.config
        title = (
            f"measured: {run.schedule.name}, pp={c.pp} dp={c.dp} stages={run.schedule.num_stages}, "
            f"m={c.microbatches}, last step"
        )
        draw_timeline([timeline], files["timeline_png"], titles=[title])
        write_trace(timeline, files["trace"])
        files["timeline"] = out_dir / "timeline.json"
        timeline.save(files["timeline"])
    return files
