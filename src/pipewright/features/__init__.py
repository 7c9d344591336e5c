"""Features: one bundle per capability, registered in one place, with no edit to the core.

A :class:`Feature` holds everything a capability adds — its action kinds (with dependency rules and
point-to-point/collective metadata), cost rules keyed by kind, schedule generators, schedule passes,
its options (a dataclass section, :mod:`pipewright.options`: a ``[table]`` in the TOML file and an
argument group of ``pipewright train``, ``simulate`` and ``plan``, each field naming the commands
that take it), ``simulate``'s hook, and its training plugin (:mod:`pipewright.runtime.core.plugin`); hook
and plugin are import paths, loaded when used, so that building the command line imports no numpy,
torch or matplotlib. :class:`Features` is an immutable set of bundles;
:func:`builtin_features` loads the library's own features (vocabulary parallelism, K-FAC in the bubbles,
asynchronous weights; listed in :mod:`pipewright.runspec.feature_registry`), and :func:`user_features`
adds the ones installed under the entry point group ``pipewright.features`` or named with ``--feature
module:attr``.

How the core uses a bundle (see ``tests/test_feature_contract.py`` for a whole toy feature):

- ``Features.kinds`` — the core kinds plus every feature's: ``Schedule(..., kinds=...)``.
- ``Features.cost(model)`` — the cost model with the features' rules in front
  (:class:`pipewright.cost.rules.RuledCost`).
- ``Features.schedules`` — extra :class:`~pipewright.schedules.registry.ScheduleInfo` entries for
  :class:`~pipewright.schedules.registry.ScheduleRegistry`.
- ``Feature.plugin_class()`` — the training plugin the composition root (:mod:`pipewright.training`)
  hands to the trainer when ``active(config, schedule)``.
- ``Feature.section`` — the feature's options, ``features.<name>`` of the run spec: its flags on
  ``train``/``simulate``/``plan`` are generated from it (:func:`pipewright.runspec.add_spec_flags`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from pipewright.deps import CORE_KINDS
from pipewright.errors import ConfigError
from pipewright.features.bundle import Feature, load
from pipewright.kinds import KindRegistry


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
            for name in [k.name for k in f.kinds] + [*f.cost_rules, *f.passes, *f.optimizers]:
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


def builtin_features() -> Features:
    """The library's own features, each package's ``FEATURE`` (its ``feature`` module): those named in
    :data:`pipewright.runspec.feature_registry.BUILTIN_SECTIONS` (the one place they are listed, as
    data: the run spec reads their option sections there without loading the bundles)."""
    from pipewright.runspec.feature_registry import BUILTIN_SECTIONS

    return Features(
        importlib.import_module(f"pipewright.features.{name}.feature").FEATURE for name in BUILTIN_SECTIONS
    )


def library_schedules() -> Any:
    """The schedule registry with the built-in features' schedules added (what the command line and
    the trainer offer)."""
    from pipewright.schedules.registry import default_registry

    return default_registry().with_schedules(*builtin_features().schedules)


def user_features(paths: Iterable[str] = ()) -> tuple[Feature, ...]:
    """Features from outside the library: every entry point of the group ``pipewright.features``
    (installed packages), then each ``"module:attr"`` of ``paths`` (``--feature``); each names a
    :class:`Feature`."""
    from importlib.metadata import entry_points

    found = [ep.load() for ep in entry_points(group="pipewright.features")]
    found += [load(p) for p in dict.fromkeys(paths)]
    for f in found:
        if not isinstance(f, Feature):
            raise ConfigError(
                f"a pipewright feature must be a pipewright.features.Feature, not {type(f).__name__}"
            )
    return tuple(found)


def all_features(paths: Iterable[str] = ()) -> Features:
    """The built-in features and the user's (:func:`user_features`)."""
    return builtin_features().with_features(*user_features(paths))
