""":class:`RunSpec`: one typed, nested description of a run, and its values by path.

A RunSpec holds the sections of :mod:`pipewright.runspec` (model, cluster, parallelism, schedule, batch,
precision, memory, framework, training, output, and the sections one command reads) and
``features``: each registered feature's own section (:mod:`pipewright.features`: ``Feature.section``,
declared with :func:`pipewright.options.option`), by feature name. A value's *path* is its place in
the spec: ``("parallelism", "tp")``, ``("model", "moe", "experts")``, ``("features", "vocab",
"parallel")``; it names the TOML key (``[parallelism] tp``) and the parsed flag's destination
(``parallelism.tp``).

Defaults depend on the command: ``train`` starts from a runnable CPU run (``--pp`` 2, four
microbatches of eight sequences), ``simulate`` leaves the pipeline size to ``--stages``/the plan
(:func:`defaults`). Pure Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import Field, field
from typing import Any

from pipewright.runspec.cluster_sections import ClusterSection, ParallelismSection
from pipewright.runspec.command_sections import (
    CalibratingSection,
    DataPrepSection,
    ExportSection,
    ExtensionsSection,
    ProfilingSection,
    ScheduleViewSection,
    SearchSection,
    SimulationSection,
)
from pipewright.runspec.feature_registry import BUILTIN_SECTIONS, builtin_section
from pipewright.runspec.fields import default, hints, section, subsection, takes, walk
from pipewright.runspec.model_sections import ModelSection
from pipewright.runspec.run_sections import (
    BatchSection,
    FrameworkSection,
    MemorySection,
    PrecisionSection,
    ScheduleSection,
)
from pipewright.runspec.training_sections import OutputSection, TrainingSection

Path = tuple[str, ...]


@section
class RunSpec:
    """A run: what is trained (model), on what (cluster), split how (parallelism), in which order
    (schedule), on how much data per step (batch), in which number formats (precision), with which
    memory savings (memory), executed by what (framework), for how long and from which data (training),
    what is written (output); the sections one command reads (simulation, search, profiling,
    calibrating, export, extensions, schedule_view, data_prep); and ``features``: each feature's
    section by name."""

    model: ModelSection = subsection(ModelSection)
    cluster: ClusterSection = subsection(ClusterSection)
    parallelism: ParallelismSection = subsection(ParallelismSection)
    schedule: ScheduleSection = subsection(ScheduleSection)
    batch: BatchSection = subsection(BatchSection)
    precision: PrecisionSection = subsection(PrecisionSection)
    memory: MemorySection = subsection(MemorySection)
    framework: FrameworkSection = subsection(FrameworkSection)
    training: TrainingSection = subsection(TrainingSection)
    output: OutputSection = subsection(OutputSection)
    simulation: SimulationSection = subsection(SimulationSection)
    search: SearchSection = subsection(SearchSection)
    profiling: ProfilingSection = subsection(ProfilingSection)
    calibrating: CalibratingSection = subsection(CalibratingSection)
    export: ExportSection = subsection(ExportSection)
    extensions: ExtensionsSection = subsection(ExtensionsSection)
    schedule_view: ScheduleViewSection = subsection(ScheduleViewSection)
    data_prep: DataPrepSection = subsection(DataPrepSection)
    features: Mapping[str, Any] = field(default_factory=dict)


#: A feature section's one-line description (its Feature's), for its help group's title.
DESCRIPTIONS: dict[type, str] = {}


def feature_sections(features: Any = None) -> dict[str, type]:
    """Each registered feature's section class by feature name (``features``: a
    :class:`~pipewright.features.Features`; default the built-in ones, read from
    :mod:`.feature_registry` without loading a feature)."""
    if features is None:
        listed = {name: (builtin_section(name), e.description) for name, e in BUILTIN_SECTIONS.items()}
    else:
        listed = {f.name: (f.section, f.description) for f in features if f.section is not None}
    DESCRIPTIONS.update(dict(listed.values()))
    return {name: section for name, (section, _) in listed.items()}


def feature_command(command: str | None) -> str | None:
    """The command whose variant a feature field uses: ``check`` runs ``train``'s options."""
    return "train" if command == "check" else command


def spec_fields(features: Mapping[str, type]) -> Iterator[tuple[Path, Field, Any]]:
    """Every field of a RunSpec with these feature sections: (path, field, type)."""
    yield from walk(RunSpec)
    for name, cls in features.items():
        resolved = hints(cls)
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                yield ("features", name, f.name), f, resolved[f.name]


def field_command(path: Path, command: str | None) -> str | None:
    """The command whose settings the field at ``path`` uses for ``command`` (a feature field on
    ``check``: ``train``'s)."""
    return feature_command(command) if path[0] == "features" else command


def field_default(path: Path, f: Field, command: str | None) -> Any:
    """The default of the field at ``path`` for ``command``."""
    return default(f, field_command(path, command))


def field_takes(path: Path, f: Field, command: str) -> bool:
    """Whether ``command`` has a flag for the field at ``path``."""
    return takes(f, field_command(path, command))  # type: ignore[arg-type]


def defaults(command: str | None = None, features: Mapping[str, type] | None = None) -> RunSpec:
    """A RunSpec of every field's default for ``command`` (the field's own default when None)."""
    features = feature_sections() if features is None else features
    values = {path: field_default(path, f, command) for path, f, _ in spec_fields(features)}
    return with_values(RunSpec(features={n: cls() for n, cls in features.items()}), values)


def get(spec: RunSpec, path: Path) -> Any:
    """The value at ``path``."""
    node: Any = spec
    for name in path:
        node = node[name] if isinstance(node, Mapping) else getattr(node, name)
    return node


def values(spec: RunSpec, features: Mapping[str, type] | None = None) -> dict[Path, Any]:
    """Every value of ``spec`` by path (its feature sections' included)."""
    features = {n: type(s) for n, s in spec.features.items()} if features is None else features
    return {path: get(spec, path) for path, _, _ in spec_fields(features)}


def with_values(spec: Any, changes: Mapping[Path, Any]) -> Any:
    """``spec`` with the values at the given paths replaced (nested sections rebuilt)."""
    groups: dict[str, dict[Path, Any]] = {}
    for path, value in changes.items():
        groups.setdefault(path[0], {})[path[1:]] = value
    if isinstance(spec, Mapping):  # the features mapping: name → section
        return {**spec, **{name: with_values(spec[name], ch) for name, ch in groups.items()}}
    updates = {
        name: ch[()] if () in ch else with_values(getattr(spec, name), ch) for name, ch in groups.items()
    }
    return dataclasses.replace(spec, **updates)
