"""Features: one bundle per capability, registered in one place, with no edit to the core.

A :class:`Feature` holds everything a capability adds — its action kinds (with dependency rules and
point-to-point/collective metadata), cost rules keyed by kind, schedule generators, schedule passes,
command-line options, and the runtime parts (handlers, output hooks, tensor specs, process groups)
given as a factory that is imported only when a run needs it, so this module and the simulator side
stay free of torch. :class:`Features` is an immutable set of bundles; :func:`builtin_features` is the
one place the library's own features (vocabulary parallelism, K-FAC in the bubbles, asynchronous
weights) are listed.

How the core uses a bundle (see ``tests/test_feature_contract.py`` for a whole toy feature):

- ``Features.kinds`` — the core kinds plus every feature's: ``Schedule(..., kinds=...)``.
- ``Features.cost(model)`` — the cost model with the features' rules in front
  (:class:`pipewright.cost.rules.RuledCost`).
- ``Features.schedules`` — extra :class:`~pipewright.schedules.registry.ScheduleInfo` entries for
  :class:`~pipewright.schedules.registry.ScheduleRegistry`.
- ``Features.runtime_parts(context)`` — merged :class:`RuntimeParts` for
  :class:`~pipewright.runtime.executor.PipelineExecutor`.
- ``Features.add_options(command, parser)`` — each feature's flags on ``simulate``/``train``/….
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipewright.deps import CORE_KINDS
from pipewright.errors import ConfigError
from pipewright.kinds import KindRegistry, KindSpec

#: The library's own feature packages, each exporting ``FEATURE`` (the one place they are listed).
BUILTIN: tuple[str, ...] = ("vocab", "kfac", "async_weights")


@dataclass(frozen=True)
class RuntimeParts:
    """What a feature adds to the executor: ``handlers`` (kind → ``fn(state, action)``),
    ``output_hooks`` (stage → ``fn(state, action, output) -> output``), ``tensor_specs`` (P2P tensor
    name → ``fn(action) -> (shape, dtype)``), ``groups`` (name → process group), ``loss_fn_off``
    (True when the feature computes the loss itself, so the default loss hook is not installed) and
    ``handler_wrappers`` (``fn(kind, handler) -> handler`` around every handler, first one innermost:
    :meth:`~pipewright.runtime.executor.PipelineExecutor.wrap_handlers`; the trainer builds its
    executors with them once stages and optimizer exist).

    What a feature changes in the trainer (:class:`pipewright.runtime.trainer.Trainer`, which names no
    feature): ``schedule`` and ``stages`` replace the compute-only schedule and this rank's stage
    modules; ``parameters`` (name → parameter) are trained with the stages (optimizer, global gradient
    norm — each rank's are counted, they are disjoint shards —, checkpoints); ``batch_everywhere``: every
    rank gets the microbatches' inputs and targets; ``after_run()`` runs after each executor run (complete
    collectives, reduce the parameters' gradients over data parallelism); ``evaluate(executor, inputs,
    targets) -> losses`` replaces the forward-only validation pass."""

    handlers: Mapping[str, Callable] = field(default_factory=dict)
    output_hooks: Mapping[int, Callable] = field(default_factory=dict)
    tensor_specs: Mapping[str, Callable] = field(default_factory=dict)
    groups: Mapping[str, Any] = field(default_factory=dict)
    loss_fn_off: bool = False
    schedule: Any = None
    stages: Mapping[int, Any] | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    batch_everywhere: bool = False
    after_run: Callable[[], None] | None = None
    evaluate: Callable[..., list[float]] | None = None
    handler_wrappers: tuple[Callable, ...] = ()

    def merged(self, other: RuntimeParts) -> RuntimeParts:
        for name in ("handlers", "output_hooks", "tensor_specs", "groups", "parameters"):
            clash = set(getattr(self, name)) & set(getattr(other, name))
            if clash:
                raise ConfigError(f"two features both provide {name} for {sorted(map(str, clash))}")
        single = {}
        for name in ("schedule", "stages", "after_run", "evaluate"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                raise ConfigError(f"two features both replace the trainer's {name}; enable only one")
            single[name] = mine if mine is not None else theirs
        return RuntimeParts(
            {**self.handlers, **other.handlers},
            {**self.output_hooks, **other.output_hooks},
            {**self.tensor_specs, **other.tensor_specs},
            {**self.groups, **other.groups},
            self.loss_fn_off or other.loss_fn_off,
            parameters={**self.parameters, **other.parameters},
            batch_everywhere=self.batch_everywhere or other.batch_everywhere,
            handler_wrappers=self.handler_wrappers + other.handler_wrappers,
            **single,
        )

    def executor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~pipewright.runtime.executor.PipelineExecutor`."""
        return {
            "handlers": dict(self.handlers),
            "output_hooks": dict(self.output_hooks),
            "tensor_specs": dict(self.tensor_specs),
            "groups": dict(self.groups),
            "handler_wrappers": list(self.handler_wrappers),
        }


def _load(path: str) -> Any:
    """The object at import path ``"package.module:attr"`` (imported only when asked for)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


#: A runtime factory: ``fn(context) -> RuntimeParts``, or its import path ``"package.module:function"``.
RuntimeFactory = Callable[[Any], RuntimeParts] | str


@dataclass(frozen=True)
class Feature:
    """One capability's bundle (see the module docstring). ``cost_rules``: kind → rule (see
    :mod:`pipewright.cost.rules`). ``passes``: name → ``fn(schedule, **options) -> schedule``.
    ``options``: ``fn(command, parser)`` adding the feature's flags to a subcommand's parser.
    ``training``: import path of a training hook for schedules whose loop the feature owns.
    ``simulate``: import path of a ``pipewright simulate`` hook (:meth:`simulate_hook`).
    ``optimizers``: ``--optimizer`` name → import path of ``attach(trainer) -> (optimizer, handlers,
    schedule)``, for optimizers whose work runs inside the schedule (K-FAC in the bubbles).
    ``train_runtime``: import path of ``fn(trainer) -> RuntimeParts`` that ``pipewright train`` calls
    on every rank with its :class:`~pipewright.runtime.trainer.Trainer` (empty parts when the config
    leaves the feature off); ``check_training``: import path of ``fn(config, spec, schedule)`` run
    before any worker starts, raising a one-line ConfigError for the combinations the feature's runtime
    does not support."""

    name: str
    kinds: tuple[KindSpec, ...] = ()
    cost_rules: Mapping[str, Callable] = field(default_factory=dict)
    schedules: tuple[Any, ...] = ()
    passes: Mapping[str, Callable] = field(default_factory=dict)
    runtime: RuntimeFactory | None = None
    options: Callable[[str, Any], None] | None = None
    training: str | None = None
    simulate: str | None = None
    optimizers: Mapping[str, str] = field(default_factory=dict)
    train_runtime: str | None = None
    check_training: str | None = None
    description: str = ""

    def simulate_hook(self) -> Callable[[Any, Any], Any] | None:
        """``fn(args, setup) -> setup | int`` (import path in :attr:`simulate`): ``pipewright simulate``
        passes its parsed options and :class:`~pipewright.plan.setup.SimSetup`; the hook returns the
        setup it transforms (or the same one), or an exit status when it ran the command itself."""
        return None if self.simulate is None else _load(self.simulate)

    def training_hook(self) -> Any | None:
        """The feature's training hook (import path ``"module:attr"`` in :attr:`training`): an object
        with ``claims(schedule) -> bool``, ``check_config(config)`` and ``trainer(run)`` for the
        schedules whose training loop the feature owns (asynchronous weight updates)."""
        return None if self.training is None else _load(self.training)

    def runtime_parts(self, context: Any = None) -> RuntimeParts:
        if self.runtime is None:
            return RuntimeParts()
        factory = _load(self.runtime) if isinstance(self.runtime, str) else self.runtime
        return factory(context)


class Features:
    """An immutable set of feature bundles; ``with_features`` returns an extended copy."""

    __slots__ = ("_bundles", "_kinds")

    def __init__(self, bundles: Iterable[Feature] = ()) -> None:
        self._bundles: dict[str, Feature] = {}
        for f in bundles:
            if f.name in self._bundles:
                raise ConfigError(f"feature {f.name!r} registered twice")
            self._bundles[f.name] = f
        owner: dict[str, str] = {}
        for f in self._bundles.values():
            for name in [k.name for k in f.kinds] + list(f.cost_rules) + list(f.passes):
                key = name
                if key in owner and owner[key] != f.name:
                    raise ConfigError(f"{name!r} is provided by both {owner[key]} and {f.name}")
                owner[key] = f.name
        self._kinds = CORE_KINDS.with_kinds(*(k for f in self._bundles.values() for k in f.kinds))

    def with_features(self, *bundles: Feature) -> Features:
        return Features([*self._bundles.values(), *bundles])

    def __iter__(self):
        return iter(self._bundles.values())

    def __len__(self) -> int:
        return len(self._bundles)

    def __getitem__(self, name: str) -> Feature:
        try:
            return self._bundles[name]
        except KeyError:
            raise ConfigError(
                f"unknown feature {name!r}; known: {', '.join(self._bundles) or 'none'}"
            ) from None

    @property
    def kinds(self) -> KindRegistry:
        """The core kinds plus every feature's."""
        return self._kinds

    @property
    def cost_rules(self) -> dict[str, Callable]:
        return {kind: rule for f in self for kind, rule in f.cost_rules.items()}

    @property
    def schedules(self) -> tuple[Any, ...]:
        return tuple(s for f in self for s in f.schedules)

    @property
    def passes(self) -> dict[str, Callable]:
        return {name: p for f in self for name, p in f.passes.items()}

    def cost(self, model: Any) -> Any:
        """``model`` with the features' cost rules in front (unchanged when there are none)."""
        from pipewright.cost.rules import with_rules

        return with_rules(model, self.cost_rules)

    def runtime_parts(self, context: Any = None, names: Iterable[str] | None = None) -> RuntimeParts:
        """Merged runtime parts of the named features (all when ``names`` is None)."""
        parts = RuntimeParts()
        for f in self if names is None else (self[n] for n in names):
            parts = parts.merged(f.runtime_parts(context))
        return parts

    def add_options(self, command: str, parser: Any) -> None:
        for f in self:
            if f.options is not None:
                f.options(command, parser)


def builtin_features() -> Features:
    """The library's own features (:data:`BUILTIN`), each package's ``FEATURE``."""
    return Features(importlib.import_module(f"pipewright.features.{name}").FEATURE for name in BUILTIN)


def library_schedules() -> Any:
    """The schedule registry with the built-in features' schedules added (what the command line and
    the trainer offer)."""
    from pipewright.schedules.registry import default_registry

    return default_registry().with_schedules(*builtin_features().schedules)


def training_hook(schedule: Any) -> Any | None:
    """The built-in feature's training hook that claims ``schedule`` (None: the plain trainer)."""
    for feature in builtin_features():
        hook = feature.training_hook()
        if hook is not None and hook.claims(schedule):
            return hook
    return None


def optimizer_hook(name: str) -> Callable[[Any], Any] | None:
    """The built-in feature's ``attach(trainer)`` for ``--optimizer name`` (None: a plain optimizer)."""
    for feature in builtin_features():
        path = feature.optimizers.get(name)
        if path is not None:
            return _load(path)
    return None


def training_parts(trainer: Any) -> RuntimeParts:
    """Collective: the built-in features' merged ``train_runtime(trainer)`` parts (a feature the
    config leaves off returns empty parts)."""
    parts = RuntimeParts()
    for feature in builtin_features():
        if feature.train_runtime is not None:
            parts = parts.merged(_load(feature.train_runtime)(trainer))
    return parts


def check_training(config: Any, spec: Any, schedule: Any) -> None:
    """Run every built-in feature's ``check_training(config, spec, schedule)`` (one-line ConfigErrors)."""
    for feature in builtin_features():
        if feature.check_training is not None:
            _load(feature.check_training)(config, spec, schedule)
