"""A training run's RunSpec from every input ``train`` and ``check`` take, and its
:class:`~pipewright.runtime.setup.config.TrainConfig` (:meth:`TrainConfig.from_spec`).

The layers, each over the one before: the command's defaults; an older ``train`` TOML (flat keys or a
``[train]`` table, a feature's ``[table]``; :func:`toml_values`); a plan file's choices
(:func:`pipewright.training.plan_values.plan_values`); and the values the run sets itself: the flags,
and a RunSpec ``--config`` file's values that differ from the defaults. Pure Python.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path as FilePath
from typing import Any

from pipewright.errors import ConfigError
from pipewright.features import Features, all_features
from pipewright.options import check_section, fields_for, flat_name, take_values
from pipewright.runspec import RunSpec, defaults, values, with_values
from pipewright.runtime.setup.config import TrainConfig, read_train_toml
from pipewright.training.plan_values import plan_values

Path = tuple[str, ...]


def feature_values(values: Mapping[str, Any], features: Features, source: str = "config") -> dict[Path, Any]:
    """Feature options by flag name (``vocab_parallel``) or TOML ``"table.key"`` (``vocab.parallel``;
    dashes read as underscores) as RunSpec values (``("features", "vocab", "parallel")``), type-checked.
    A key no feature declares is a one-line ConfigError naming it."""
    out: dict[Path, Any] = {}
    rest = dict(values)
    for feature in features:
        if feature.section is None:
            continue
        mine, left = take_values(feature.section, feature.table_name, rest)  # defaults filled in
        check_section(feature.section, mine, source)
        names = {flat_name(f): f.name for f in fields_for(feature.section)}
        given = {_flat(key, names) for key in rest if key not in left}  # only the options given
        out |= {("features", feature.name, names[flat]): mine[flat] for flat in given}
        rest = left
    if rest:
        key = next(iter(rest))
        raise ConfigError(f"{source}: unknown key {key!r}; no feature or training field has that name")
    return out


def _flat(key: str, names: Mapping[str, str]) -> str:
    """The flag name of a feature option's key: a flag name itself, or a ``"table.field"``."""
    name = key.replace("-", "_")
    _, dot, field = name.partition(".")
    return next(flat for flat, f in names.items() if f == field) if dot else name


def flat_values(values: Mapping[str, Any], features: Features, source: str = "config") -> dict[Path, Any]:
    """Values by TrainConfig field name and feature option (flag name, or ``"table.key"``) as RunSpec
    values by path (an older ``train`` TOML, the measured table's rows)."""
    core, extra = TrainConfig.spec_values(values, source=source)
    return core | feature_values(extra, features, source)


def toml_values(path: str | FilePath, features: Features) -> dict[Path, Any]:
    """The RunSpec values of an older ``train`` TOML file (its core keys and the features' options)."""
    return flat_values(read_train_toml(path), features, str(path))


def run_spec(
    spec: RunSpec, given: Collection[Path] = (), command: str = "train", train_toml: str | None = None
) -> tuple[RunSpec, frozenset[Path]]:
    """``spec`` (the command's defaults, a RunSpec ``--config`` file, the flags) with an older ``train``
    TOML and the plan of ``parallelism.plan`` under what the run sets itself (the paths ``given`` by
    flags and the values that differ from ``command``'s defaults); and every path some input set."""
    known = {n: type(s) for n, s in spec.features.items()}
    start = values(defaults(command, known), known)
    now = values(spec, known)
    chosen = set(given) | {p for p, v in now.items() if v != start[p]}
    below: dict[Path, Any] = {}
    if train_toml is not None:
        below |= toml_values(train_toml, all_features(spec.extensions.feature or ()))
    if spec.parallelism.plan:
        below |= plan_values(spec.parallelism.plan, {p: now[p] for p in chosen})
    spec = with_values(spec, {p: v for p, v in below.items() if p not in chosen})
    return spec, frozenset(chosen | set(below))


def config_from_values(
    values: Mapping[str, Any], features: Features | None = None, source: str = "config"
) -> TrainConfig:
    """The TrainConfig of values by field name and feature option (:func:`flat_values`) over ``train``'s
    defaults: ``config_from_values({"pp": 4, "vocab_parallel": "alg1"})``."""
    from pipewright.runspec import feature_sections

    features = all_features(values.get("feature_paths") or ()) if features is None else features
    start = defaults("train", feature_sections(features))
    return TrainConfig.from_spec(with_values(start, flat_values(values, features, source)))


def config_from_toml(path: str | FilePath, features: Features | None = None) -> TrainConfig:
    """The TrainConfig of an older ``train`` TOML file alone (``train``'s defaults under it)."""
    return config_from_values(read_train_toml(path), features, str(path))


def replaced(config: TrainConfig, features: Features | None = None, **values: Any) -> TrainConfig:
    """``config`` with values by field name and feature option (flag name, or ``"table.key"``)
    replaced: ``replaced(config, pp=4, vocab_parallel="alg1")``; a feature option changes its section."""
    import dataclasses

    features = all_features(config.feature_paths) if features is None else features
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    core = {k: v for k, v in values.items() if k in names}
    changes: dict[str, dict[str, Any]] = {}
    for (_, name, option), value in feature_values(
        {k: v for k, v in values.items() if k not in names}, features
    ).items():
        changes.setdefault(name, {})[option] = value
    sections = dict(config.features)
    for feature in features:
        if feature.name in changes:
            now = sections.get(feature.name) or feature.section()
            sections[feature.name] = dataclasses.replace(now, **changes[feature.name])
    return dataclasses.replace(config, **core, features=sections)


def batch_from_global(config: TrainConfig, global_batch: int | None, microbatches_set: bool) -> TrainConfig:
    """``config`` with microbatches = ``global_batch`` ÷ (b × dp), as ``plan`` and ``simulate`` read
    ``--global-batch-size``, unless ``microbatches_set`` (then the two must agree). One line when they
    do not, or when b × dp does not divide the global batch."""
    if global_batch is None:
        return config
    per_step = config.microbatch_size * config.dp
    if microbatches_set:
        if config.global_batch != global_batch:
            raise ConfigError(
                f"--global-batch-size {global_batch} but --microbatch-size {config.microbatch_size} × "
                f"--microbatches {config.microbatches} × --dp {config.dp} = {config.global_batch}; "
                "give one of --global-batch-size, --microbatches"
            )
        return config
    if per_step < 1 or global_batch % per_step:
        raise ConfigError(
            f"--global-batch-size {global_batch} is not a multiple of --microbatch-size × --dp = "
            f"{config.microbatch_size}×{config.dp} = {per_step}"
        )
    return replace(config, microbatches=global_batch // per_step)


def check_planned_cluster(config: TrainConfig, nodes: int, gpus_per_node: int) -> None:
    """One line when the run's processes (tp × cp × pp × dp) are not the devices of the cluster it is
    planned for (``--nodes`` × ``--gpus-per-node``, given)."""
    devices = nodes * gpus_per_node
    if devices != config.world_size:
        raise ConfigError(
            f"the run is planned for {nodes} × {gpus_per_node} = {devices} devices (--nodes × "
            f"--gpus-per-node) but tp × cp × pp × dp = {config.tp}×{config.cp}×{config.pp}×{config.dp} = "
            f"{config.world_size} processes; make them equal or drop --nodes/--gpus-per-node"
        )
