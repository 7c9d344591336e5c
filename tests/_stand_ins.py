"""Empty stand-in modules for the export tests, where a trainer's package imports at import time a
module that has no CPU build (each test module states which and why); and what those tests do where a
trainer's package that the README's test command installs is missing (:func:`missing`)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterable, Iterator
from typing import NoReturn

import pytest


def _call(self, *args, **_kwargs):
    """A stand-in instance called: a decorator's result is the function it decorates."""
    return args[0] if args else self


class _Empty(type):
    """A stand-in class: any attribute is another stand-in class, subscripting gives itself."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Empty(name, (), {"__init__": lambda self, *a, **k: None, "__call__": _call})
        setattr(cls, name, sub)
        return sub

    def __getitem__(cls, _item):
        return cls


class _Module(types.ModuleType):
    """An empty stand-in module: any attribute is a stand-in class."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so that submodules import

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(_Empty(self.__name__, (), {}), name)
        setattr(self, name, value)
        return value


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves :class:`_Module` for the modules of ``roots`` and their submodules."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(self, name, path, target=None):
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module) -> None:
        pass


@contextlib.contextmanager
def stand_ins(roots: Iterable[str]) -> Iterator[None]:
    """Empty modules for ``roots`` (and their submodules) while the block runs; removed after, from
    the import system and from ``sys.modules``."""
    finder = _StandIns(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if isinstance(sys.modules[m], _Module)]:
            del sys.modules[name]


def missing(reason: str) -> NoReturn:
    """A trainer's package the README's test command installs is missing: the test fails where the
    ``CI`` environment variable is set (a check that never runs there checks nothing) and is skipped
    elsewhere, with ``reason`` (the install command)."""
    if os.environ.get("CI", "").strip().lower() not in {"", "0", "false", "no"}:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)
