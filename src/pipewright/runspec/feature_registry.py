"""The library's own features as data: each one's name, the class of its option section (``features.<name>``
of a RunSpec) and its one-line description (the title of its flags' help group).

This is the one place the built-in features are listed. The run spec reads their sections here without
loading a feature: a section is a dataclass of ``pipewright.features.<name>.options``, a pure module that
imports nothing above :mod:`pipewright.options` (``tests/test_structure.py`` checks both), so the run spec
depends on no feature's kinds, passes, cost rules or runtime. :func:`pipewright.features.builtin_features`
loads the bundle (``FEATURE``) of each name listed here; a bundle's section and description are the ones
listed (``tests/test_runspec.py``). Pure Python.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinSection:
    """A built-in feature's option section: the class name in ``pipewright.features.<name>.options``
    and the feature's one-line description."""

    section: str
    description: str


#: The built-in features by name, in the order their help groups and TOML tables appear.
BUILTIN_SECTIONS: dict[str, BuiltinSection] = {
    "vocab": BuiltinSection(
        "VocabOptions", "vocabulary parallelism: embedding and output layer split over all pipeline ranks"
    ),
    "kfac": BuiltinSection(
        "KfacOptions", "PipeFisher: K-FAC curvature, inversion and preconditioning in the pipeline bubbles"
    ),
    "async_weights": BuiltinSection(
        "AsyncOptions",
        "asynchronous pipelines: weight stashing, 2BW, PipeOptim prediction, delay compensation",
    ),
}


def builtin_section(name: str) -> type:
    """The option section class of built-in feature ``name`` (only its options module is imported)."""
    module = importlib.import_module(f"pipewright.features.{name}.options")
    return getattr(module, BUILTIN_SECTIONS[name].section)
