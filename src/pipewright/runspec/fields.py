"""A RunSpec field's declaration: its value type (closed choices as ``Literal``), default, command-line
flag, help, the commands that take it, and what one command sets differently.

:func:`spec_field` is the one declaration every reader uses: the flag generator
(:mod:`pipewright.runspec.flags`), the TOML reader and writer (:mod:`pipewright.runspec.toml_io`) and
the checks (:mod:`pipewright.runspec.validation`). A field's ``variants`` give one command its own
``default``, ``help``, ``choices`` or extra option strings (``aliases``: ``simulate --stages/-p`` for
``--pp``). A field with no commands is read from and written to TOML only. Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, field
from typing import Any, Literal

#: The commands whose flags a RunSpec declares.
COMMANDS = (
    "simulate",
    "plan",
    "train",
    "check",
    "export-plan",
    "profile",
    "calibrate",
    "schedule show",
    "schedule export",
    "data prepare",
)
#: ``pipewright schedule``'s verbs (each a command of its own: ``schedule show`` takes no ``--format``).
SCHEDULE = ("schedule show", "schedule export")
#: The commands that run training (``check`` trains twice and compares).
TRAINING = ("train", "check")
#: The commands that price a run without running it.
PRICING = ("simulate", "plan")
#: The commands that price or run a model.
MODEL_COMMANDS = (*PRICING, *TRAINING)
_VARIANT_KEYS = frozenset({"default", "help", "choices", "aliases", "positional"})


def spec_field(
    default: Any,
    flag: str | None,
    help: str,
    *,
    commands: tuple[str, ...] = (),
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    nargs: str | None = None,
    minimum: float | None = None,
) -> Any:
    """A section field: default ``default``; flag ``flag`` (``--no-x`` for a switch whose default is
    True; None: TOML only); ``help`` (its docstring, shown with the default); ``commands``: those that
    take the flag;
    ``variants``: command → its own ``default``/``help``/``choices``/``aliases``, or ``positional``:
    the argument's name (a positional argument there instead of the flag); ``nargs="+"``: a
    tuple given as several words (other tuples take one comma-separated word); ``minimum``: the least
    value a number may take (numbers are otherwise at least 0)."""
    for command in [*commands, *(variants or {})]:
        if command not in COMMANDS:
            raise ValueError(f"field {flag}: unknown command {command!r}; known: {', '.join(COMMANDS)}")
    for command, variant in (variants or {}).items():
        if command not in commands or not set(variant) <= _VARIANT_KEYS:
            raise ValueError(f"field {flag}: a variant of {command!r} must be of a listed command")
    meta = {
        "flag": flag,
        "help": help,
        "commands": tuple(commands),
        "variants": {k: dict(v) for k, v in (variants or {}).items()},
        "nargs": nargs,
        "minimum": minimum,
    }
    if isinstance(default, list | dict | set):
        raise TypeError(f"field {flag}: give a tuple, not a mutable default")
    return field(default=default, metadata=meta)


def variant_of_each(commands: tuple[str, ...], **settings: Any) -> dict[str, dict[str, Any]]:
    """The same variant for each of ``commands`` (``schedule show`` and ``schedule export``)."""
    return {command: dict(settings) for command in commands}


def section(cls: type) -> type:
    """A frozen dataclass whose fields are spec fields or sub-sections (each a dataclass field holding
    a section, default its defaults)."""
    return dataclasses.dataclass(frozen=True)(cls)


def subsection(cls: type) -> Any:
    """A field holding section ``cls`` (its defaults when not given)."""
    return field(default_factory=cls)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of section ``cls``."""
    module = __import__(cls.__module__, fromlist=["_"])
    return typing.get_type_hints(cls, vars(module))


def walk(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field, Any]]:
    """Every spec field under section ``cls``, depth first: (path of names, field, type)."""
    resolved = hints(cls)
    for f in dataclasses.fields(cls):
        kind = resolved[f.name]
        if "flag" in f.metadata:
            yield (*path, f.name), f, kind
        elif dataclasses.is_dataclass(kind):
            yield from walk(kind, (*path, f.name))


def subsections(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type]]:
    """Section ``cls`` and every section under it, with its path, depth first."""
    yield path, cls
    resolved = hints(cls)
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata and dataclasses.is_dataclass(resolved[f.name]):
            yield from subsections(resolved[f.name], (*path, f.name))


def setting(f: Field, command: str, key: str) -> Any:
    """``key`` (help, choices, aliases) of field ``f`` for ``command``: its variant's, else the field's."""
    variant = f.metadata["variants"].get(command, {})
    return variant[key] if key in variant else f.metadata.get(key)


def default(f: Field, command: str | None = None) -> Any:
    """Field ``f``'s default for ``command`` (its variant's), else the field's own."""
    variant = f.metadata.get("variants", {}).get(command, {})
    if "default" in variant:
        value = variant["default"]
        return tuple(value) if isinstance(value, list) else value
    if f.default is not MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def takes(f: Field, command: str) -> bool:
    return command in f.metadata.get("commands", ())


def base_type(kind: Any) -> Any:
    """``X | None`` → X; other types unchanged."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else kind
    return kind


def choices(kind: Any) -> tuple[Any, ...] | None:
    """The closed choices of a ``Literal`` type (through ``| None``), else None."""
    kind = base_type(kind)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def optional(kind: Any) -> bool:
    """Whether the type takes None."""
    return type(None) in typing.get_args(kind)
