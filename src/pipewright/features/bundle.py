"""One feature's bundle (:class:`Feature`; the package docstring of :mod:`pipewright.features` says what
each field adds) and :func:`load`, which imports a hook or plugin by path when it is used. The feature
packages' ``feature`` modules import these; :mod:`pipewright.features` loads those modules by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipewright.errors import ConfigError
from pipewright.kinds import KindSpec


def load(path: str) -> Any:
    """The object at import path ``"package.module:attr"`` (imported only when asked for)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{path!r} is not an import path of the form package.module:attr")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {path}: {exc}") from None
    except Exception as exc:  # the module itself raises (or does not compile): its first line, -v for all
        import traceback

        first = (str(exc).splitlines() or [""])[0][:200]
        error = ConfigError(
            f"cannot load {path}: importing {module} raised {type(exc).__name__}: {first} "
            "(-v shows the traceback)"
        )
        error.details = traceback.format_exc()
        raise error from None


@dataclass(frozen=True)
class Feature:
    """One capability's bundle (see the module docstring). ``cost_rules``: kind → rule (see
    :mod:`pipewright.cost.rules`). ``passes``: name → ``fn(schedule, **options) -> schedule``.
    ``simulate``: import path of a ``pipewright simulate`` hook (:meth:`simulate_hook`).
    ``section``: the dataclass of the feature's options (:mod:`pipewright.options`): its training
    options, read from the TOML ``[table]`` (default: the name) and ``train``'s flags, and the flags
    of ``simulate`` and ``plan`` its fields name.
    ``optimizers``: the ``--optimizer`` names the feature provides (its plugin wraps or replaces the
    optimizer the trainer builds for them, :data:`pipewright.optim.FEATURE_BASE`).
    ``plugin``: import path of its :class:`~pipewright.runtime.core.plugin.TrainingPlugin` subclass."""

    name: str
    kinds: tuple[KindSpec, ...] = ()
    cost_rules: Mapping[str, Callable] = field(default_factory=dict)
    schedules: tuple[Any, ...] = ()
    passes: Mapping[str, Callable] = field(default_factory=dict)
    simulate: str | None = None
    section: type | None = None
    table: str = ""
    plugin: str | None = None
    optimizers: tuple[str, ...] = ()
    description: str = ""

    @property
    def table_name(self) -> str:
        """The TOML table of the feature's options."""
        return self.table or self.name

    def simulate_hook(self) -> Callable[[Any, Any], Any] | None:
        """``fn(request, setup) -> setup | int`` (import path in :attr:`simulate`): ``pipewright
        simulate`` passes its :class:`~pipewright.plan.request.SimulateRequest` and
        :class:`~pipewright.plan.setup.SimSetup`; the hook returns the setup it transforms (or the same
        one), or an exit status when it ran the command itself."""
        return None if self.simulate is None else load(self.simulate)

    def plugin_class(self) -> Any | None:
        """The feature's training plugin class (import path in :attr:`plugin`), or None."""
        return None if self.plugin is None else load(self.plugin)
