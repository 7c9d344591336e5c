"""``pipewright.pipeline(layers, loss_fn, data=…)``: any model given as a list of layers, trained by
``pipewright train``'s machinery (schedules, recomputation, precision, ZeRO-1, checkpoints, the run
guard) — see docs/models.md, "Any model as a list of layers".

The model (:class:`~pipewright.models.layer_list.LayerList`) rides in the
:class:`~pipewright.runtime.core.trainer.PreparedRun` (its ``model``); the trainer builds the rank's stages,
loss and boundary shapes from it and reads its data. Modules shared by several positions
(:class:`~pipewright.models.layer_list.Tied`) are kept tied by :class:`TiedLayersPlugin`, a training
plugin (:mod:`pipewright.runtime.core.plugin`) added to the run's plugins: after each backward it sums the
copies' gradients over the pipeline ranks that hold one (an all-reduce per (dp, tp) replica), and it
marks every copy but one ``counted_elsewhere`` so the global gradient norm counts the module once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from pipewright.errors import ConfigError
from pipewright.models.layer_list import DataFn, LayerList, LossFn, Tied
from pipewright.models.spec import ModelSpec
from pipewright.options import update_rule_names
from pipewright.runtime.checkpointing.checkpoint import read_meta, resumable_checkpoint, same_model
from pipewright.runtime.checkpointing.fingerprint import fingerprint
from pipewright.runtime.checkpointing.run_folder import check_out, claim, no_checkpoint_advice
from pipewright.runtime.core.plugin import BuildContext, Built, TrainingPlugin
from pipewright.runtime.core.trainer import PreparedRun, TrainResult
from pipewright.runtime.parallel.process_mesh import coords_to_rank
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import init_from_env, running_under_torchrun
from pipewright.training.prepare_run import active_plugins, check_config, default_out_dir, run_features
from pipewright.training.prepare_run import resolve_schedule as checked_schedule

if TYPE_CHECKING:
    from pipewright.training.workers import Spawn

log = logging.getLogger(__name__)

__all__ = ["LayerPipeline", "Tied", "TiedLayersPlugin", "pipeline"]


#: TrainConfig fields a layer list cannot use (they describe the transformer families), with the reason.
def _unsupported(config: TrainConfig) -> dict[str, tuple[bool, str]]:
    """Each option a layer-list model does not take, by flag: whether ``config`` sets it (other than
    TrainConfig's default) and why it does not apply."""
    base = TrainConfig()
    return {
        "--tp": (config.tp != base.tp, "tensor parallelism needs the families' parallel layers"),
        "--init-from": (config.init_from != base.init_from, "Hugging Face weights fit the families' modules"),
        "--tie-embeddings": (
            config.tie_embeddings != base.tie_embeddings,
            "tie modules with pipewright.Tied entries instead",
        ),
        "--sequence-parallel": (
            config.sequence_parallel != base.sequence_parallel,
            "it needs tensor parallelism",
        ),
        "--scatter-gather": (config.scatter_gather != base.scatter_gather, "it needs tensor parallelism"),
        "--cp": (config.cp != base.cp, "context parallelism rewrites the families' attention"),
        "--ep": (config.ep != base.ep, "expert parallelism shards the families' MoE layers"),
    }


class TiedLayersPlugin(TrainingPlugin):
    """Keeps every :class:`~pipewright.models.layer_list.Tied` module one module across the pipeline
    ranks (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.groups: list[tuple[Any, list[Any]]] = []

    def build(self, ctx: BuildContext) -> Built:
        run, mesh, schedule = ctx.run, ctx.mesh, ctx.schedule
        for key, stages in sorted(run.model.tied_stages(run.layout).items()):
            ranks = sorted({schedule.rank_of(s) for s in stages})
            mine = [m for s, m in ctx.stages.items() if key in m.tied]
            params = list(mine[0].tied[key].parameters()) if mine else []
            if mine and mesh.pp_rank != ranks[0]:
                for p in params:
                    p.counted_elsewhere = True  # the first holder counts it in the gradient norm
            if len(ranks) < 2:
                continue
            group = _group(mesh, tuple(ranks))
            if mine:
                self.groups.append((group, params))
        return Built()

    def after_run(self) -> None:
        """∂L/∂θ of a tied module = the sum of its copies' gradients (before the dp reduction is
        waited: the sum commutes with the dp average)."""
        for group, params in self.groups:
            for p in params:
                if p.grad is None:
                    p.grad = p.detach().new_zeros(p.shape)
                dist.all_reduce(p.grad, group=group)


def _group(mesh: Any, ranks: tuple[int, ...]) -> Any:
    """This rank's group of pipeline ranks ``ranks`` in its (dp, tp) replica, made once per mesh
    (collective: every rank creates every group, in one order)."""
    cache = mesh.__dict__.setdefault("_tied_layer_groups", {})
    if ranks not in cache:
        mine = None
        for d in range(mesh.dp):
            for t in range(mesh.tp):
                members = [coords_to_rank(d, p, t, mesh.dp, mesh.pp, mesh.tp) for p in ranks]
                group = dist.new_group(members)
                if mesh.rank in members:
                    mine = group
        cache[ranks] = mine
    return cache[ranks]


def _kind(layer: Any) -> str:
    """A layer's class or factory name (functions and classes: their qualified name)."""
    return getattr(layer, "__qualname__", None) or type(layer).__name__


class LayerPipeline:
    """A :class:`~pipewright.models.layer_list.LayerList` with the calls that train it: :meth:`prepare`
    (every check before a worker starts) and :meth:`train` (the worker processes, or this process's
    share under torchrun)."""

    def __init__(self, model: LayerList) -> None:
        self.model = model

    def config(self, config: TrainConfig | None = None, **values: Any) -> TrainConfig:
        """``config`` (default: TrainConfig's defaults) with ``values`` replaced (fields, and feature options
        by flag name: :func:`~pipewright.training.run_inputs.replaced`)."""
        from pipewright.training.run_inputs import replaced

        return replaced(config or TrainConfig(), **values)

    def spec(self) -> ModelSpec:
        """A ModelSpec standing for the list (checkpoint fingerprints, metrics): one "token" per row;
        its name carries a digest of the layers' kinds and parameter counts."""
        kinds = [_kind(e.layer if isinstance(e, Tied) else e) for e in self.model.entries]
        text = repr((kinds, self.model.parameter_counts()))
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        n = len(self.model)
        return ModelSpec(f"{self.model.name}-{digest}", n, 1, 1, 1, 1, family="layer-list")

    def prepare(self, config: TrainConfig | None = None, **values: Any) -> PreparedRun:
        """Check the config against the list (one-line ConfigErrors), resolve the schedule and the
        partition, choose the run folder and the resume point."""
        features = run_features(self.config(config, **values))
        config = check_config(self.config(config, **values), features)
        for flag, (given, why) in _unsupported(config).items():
            if given:
                raise ConfigError(f"{flag} does not apply to a layer-list model ({why}); drop it")
        schedule = checked_schedule(config, features)
        layout = self.model.layout(schedule.num_stages)
        spec = self.spec()
        plugins = active_plugins(config, schedule, features)
        for plugin in plugins:
            plugin.check(config, schedule, spec)
        fp = fingerprint(spec, "layer-list")
        out_dir = Path(config.out) if config.out else default_out_dir()
        if config.out:
            check_out(out_dir, resume=config.resume, overwrite=config.overwrite)
        resume_from, start = None, 0
        if config.resume:
            resume_from, warnings = resumable_checkpoint(out_dir / "checkpoints")
            for warning in warnings:
                log.warning("%s", warning)
            if resume_from is None:
                raise ConfigError(no_checkpoint_advice(out_dir, warnings))
            meta = read_meta(resume_from)
            if not same_model(meta, fp, fp):
                raise ConfigError(
                    f"--resume: checkpoint {resume_from} belongs to another model; use a new --out"
                )
            start = int(meta["step"])
        update = tuple(n for f in features if f.section is not None for n in update_rule_names(f.section))
        return PreparedRun(
            config,
            spec,
            schedule,
            layout,
            out_dir,
            fp,
            resume_from,
            start,
            plugins=(*plugins, TiedLayersPlugin),
            update_settings=update,
            model=self.model,
        )

    def train(
        self, config: TrainConfig | None = None, *, spawn: Spawn | None = None, **values: Any
    ) -> TrainResult | None:
        """Train: tp × pp × dp local worker processes (one CPU thread each; a list of layers refuses
        cp), started by :func:`~pipewright.training.workers.launcher` (``spawn``), or this process's
        share when launched by torchrun (give ``out``). Returns rank 0's result (others: None)."""
        from pipewright.training.workers import launcher, train_worker

        if running_under_torchrun():
            c = self.config(config, **values)
            init_from_env(cpu_allocator=c.cpu_allocator)
            if not c.out:
                raise ConfigError("under torchrun give the run folder (out=...), the same on every rank")
            return train_worker(dist.get_rank(), self.prepare(c))
        run = self.prepare(config, **values)
        c = run.config
        folder, lock = claim(
            Path(c.out) if c.out else None, run.out_dir.parent, resume=c.resume, overwrite=c.overwrite
        )
        run = replace(run, out_dir=folder)
        with lock:
            start = launcher(spawn)
            return start(train_worker, c.world_size, (run,), timeout_s=7 * 24 * 3600, forward_sigterm=True)[0]


def pipeline(
    layers: Sequence[Any],
    loss_fn: LossFn,
    *,
    data: DataFn,
    partition: Any = "uniform",
    name: str = "layer-list",
) -> LayerPipeline:
    """Any model as a list of layers (DeepSpeed ``PipelineModule``'s convention): ``layers`` are
    ``nn.Module``s, factories building one, or :class:`~pipewright.models.layer_list.Tied` entries;
    ``loss_fn(output, target)`` is a microbatch's mean loss; ``data(split, step, rows)`` gives global
    batch ``step`` of ``split`` ("train"/"val") as (inputs, targets); ``partition``: "uniform",
    "parameters", a ``pipewright profile`` table, a layout string, a plan file or layer counts
    (:class:`~pipewright.models.layer_list.LayerList`). Returns a :class:`LayerPipeline`."""
    return LayerPipeline(LayerList(layers, loss_fn, data, partition, name))
