"""Preparing a training run in the launching process: everything that can be checked before any worker
starts (config and the features' options, data file, schedule, layout vs. world size, checkpoint
fingerprint), and the features' training plugins that take part in the run."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from pipewright.data import open_dataset
from pipewright.errors import ConfigError
from pipewright.features import Features, all_features
from pipewright.ir import Schedule
from pipewright.models.layout import resolve_layout
from pipewright.options import check_section, fields_for, flat_name, update_rule_names
from pipewright.runtime.checkpointing.checkpoint import read_meta, resumable_checkpoint, same_model
from pipewright.runtime.checkpointing.fingerprint import fingerprint
from pipewright.runtime.checkpointing.resume_check import model_difference
from pipewright.runtime.checkpointing.run_folder import check_out, no_checkpoint_advice
from pipewright.runtime.core.schedule_source import resolve_schedule as schedule_of
from pipewright.runtime.core.trainer import PreparedRun
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import default_backend
from pipewright.runtime.setup.size_check import check_fits
from pipewright.schedules.registry import default_registry

log = logging.getLogger(__name__)


def run_features(config: TrainConfig) -> Features:
    """The built-in features and the user's: entry points and the config's ``--feature`` paths."""
    return all_features(config.feature_paths)


def resolve_options(config: TrainConfig, features: Features | None = None) -> TrainConfig:
    """The config with every feature's options section (its defaults where the config has none). A
    section of no registered feature, or of another type than the feature's, is a one-line
    ConfigError."""
    features = run_features(config) if features is None else features
    sections = {f.name: f.section for f in features if f.section is not None}
    for name, options in config.features.items():
        if name not in sections:
            raise ConfigError(f"config: options of {name!r}, which is no registered feature")
        if type(options) is not sections[name]:
            raise ConfigError(
                f"config: the options of feature {name!r} must be a {sections[name].__name__}, "
                f"not {type(options).__name__}"
            )
    resolved = {name: config.features.get(name) or cls() for name, cls in sections.items()}
    for name, options in resolved.items():  # wrong types: one line naming the option
        check_section(
            sections[name], {flat_name(f): getattr(options, f.name) for f in fields_for(sections[name])}
        )
    return replace(config, features=resolved)


def check_config(config: TrainConfig, features: Features | None = None) -> TrainConfig:
    """:func:`resolve_options`, then each feature section's own ``check(options, config)`` and the core
    checks (:meth:`TrainConfig.check`): one-line ConfigErrors. Returns the resolved config."""
    features = run_features(config) if features is None else features
    config = resolve_options(config, features)
    for feature in features:
        check = getattr(feature.section, "check", None)
        if check is not None:
            check(config.features[feature.name], config)
    config.check()
    check_optimizer(config.optimizer, features)
    return config


def check_optimizer(name: str, features: Features) -> None:
    """One-line ConfigError unless ``name`` is a built-in optimizer or one a feature provides."""
    from pipewright.optim import OPTIMIZERS

    known = [*OPTIMIZERS, *(n for f in features for n in f.optimizers)]
    if name not in known:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(known)}")


def active_plugins(config: TrainConfig, schedule: Schedule, features: Features) -> list[type]:
    """The training plugin classes of the features that take part in this run, in registration order."""
    out = []
    for f in features:
        cls = f.plugin_class()
        if cls is not None and cls.active(config, schedule):
            out.append(cls)
    return out


def resolve_schedule(config: TrainConfig, features: Features | None = None) -> Schedule:
    """The config's compute-only schedule (a name in the library, with the features' schedules, or a
    PyTorch CSV), checked by the plugins active on it (before the model is known)."""
    features = run_features(config) if features is None else features
    return _checked_schedule(check_config(config, features), features)


def _checked_schedule(config: TrainConfig, features: Features) -> Schedule:
    """:func:`resolve_schedule` for a config :func:`check_config` has already checked (its warnings
    are printed once)."""
    sched = schedule_of(config, default_registry().with_schedules(*features.schedules))
    for plugin in active_plugins(config, sched, features):
        plugin.check(config, sched, None)
    return sched


def default_out_dir(root: str | Path = "runs") -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    n = 1
    while path.exists():
        path = Path(root) / f"{stamp}-{n}"
        n += 1
    return path


def prepare(
    config: TrainConfig,
    *,
    world_size: int | None = None,
    features: Features | None = None,
    check_size: bool = True,
) -> PreparedRun:
    """Check the config, data, schedule, layout and resume point; choose the output folder; pick the
    features' training plugins active for the run. ``features``: default the built-in ones and the
    config's ``feature_paths`` (:func:`run_features`). ``check_size``: refuse a run that does not fit
    this machine or its ``--out`` disk (False for ``--measure``, which builds no real tensor)."""
    features = run_features(config) if features is None else features
    config = check_config(config, features)
    if world_size is not None and world_size != config.world_size:
        raise ConfigError(
            f"tp × cp × pp × dp = {config.tp}×{config.cp}×{config.pp}×{config.dp} = {config.world_size} "
            f"but there are {world_size} processes; make the product equal the process count"
        )
    if config.data is not None and not Path(config.data).exists():
        raise ConfigError(f"data file {config.data} does not exist; give an existing --data path or omit it")
    schedule = _checked_schedule(config, features)
    layout = resolve_layout(config.layout, config.num_layers(), schedule.num_stages)  # before the (slow) data
    dataset = open_dataset(config.data, tokenizer=config.tokenizer, progress=config.progress)
    spec = config.model_spec(dataset.vocab_size)
    evaluates = 0 < config.eval_every <= config.steps
    dataset.check_size(spec.seq_len, ("train", "val") if evaluates else ("train",))  # as the workers will
    plugins = active_plugins(config, schedule, features)
    for plugin in plugins:  # the features' unsupported combinations (--vocab-parallel …)
        plugin.check(config, schedule, spec)
    fp = fingerprint(spec, config.tokenizer, config.tp)
    if config.out is not None and not config.out.strip():
        raise ConfigError("--out needs a folder name (omit it for a new folder under runs/)")
    out_dir = Path(config.out) if config.out else default_out_dir()
    if config.out:  # another run's folder, or a live run's: refused (runtime/checkpointing/run_folder.py)
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
            differs = model_difference(meta, spec, config.tp, config.flat())  # checkpointing/resume_check.py
            raise ConfigError(
                f"--resume: checkpoint {resume_from} belongs to another model ({meta.get('model', '?')}"
                + (f"; saved with {differs}" if differs else "")
                + "); use the same model dimensions and --tp, or a new --out"
            )
        start = int(meta["step"])
        if start >= config.steps:
            raise ConfigError(
                f"--resume: the run in {out_dir} is done (its checkpoint is at step {start}, --steps is "
                f"{config.steps}); give --steps above {start} to train on, or a new --out for a new run"
            )
    update = tuple(n for f in features if f.section is not None for n in update_rule_names(f.section))
    run = PreparedRun(
        config,
        spec,
        schedule,
        layout,
        out_dir,
        fp,
        resume_from,
        start,
        plugins=tuple(plugins),
        update_settings=update,
    )
    if check_size:
        check_fits(run, cpu=default_backend() == "gloo" and world_size is None)  # runtime/setup/size_check.py
    return run
