"""Option sections: a feature's training options as one frozen dataclass, whose field metadata gives
each option's command-line flag, help, choices and whether it changes the update rule.

One declaration serves three readers: the TOML file (a ``[table]`` named for the section, keys named
like the fields, or the flag's name in ``[train]``), the command line (:func:`add_flags`: one argument
group per section, defaults shown) and the code that reads the values (:func:`read_section`). A value
is stored in :class:`~pipewright.runtime.config.TrainConfig` under its *flat name*, the flag without
its dashes (``--kfac-base`` → ``kfac_base``), so a run's ``config.json`` and checkpoints record every
option under the name its flag has. Pure Python.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    update_rule: bool = False,
    group: str = "",
) -> Any:
    """A section field: ``flag`` (``--name``; ``--no-name`` for a switch that turns a True default
    off), ``help``, ``choices``; ``update_rule``: the option changes which per-parameter optimizer
    state a run keeps (a resume with another value is refused); ``group``: the help group it is listed
    under (the training config's fields)."""
    meta = {"flag": flag, "help": help, "choices": choices, "update_rule": update_rule, "group": group}
    return field(default=default, metadata=meta)


def flat_name(f: Field) -> str:
    """The name a section field is stored under: its flag without dashes (``--kfac-base`` → ``kfac_base``)."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def flat_defaults(cls: type) -> dict[str, Any]:
    """Every option of section ``cls`` with its default, by flat name."""
    return {flat_name(f): _default(f) for f in fields(cls)}


def update_rule_names(cls: type) -> tuple[str, ...]:
    """Flat names of the section's options that change the optimizer's update rule."""
    return tuple(flat_name(f) for f in fields(cls) if f.metadata.get("update_rule"))


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"option {f.name} has no default")


def take_values(cls: type, table: str, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``values`` (flat name, or ``"table.key"`` from a TOML ``[table]``) into the options of
    section ``cls`` (by flat name, defaults filled in) and the rest. A ``[table]`` key may use dashes."""
    mine, rest = flat_defaults(cls), dict(values)
    by_key = {f.name: flat_name(f) for f in fields(cls)}
    for key in list(rest):
        name = key.replace("-", "_")
        if name in mine:
            mine[name] = rest.pop(key)
        elif name.startswith(f"{table}.") and name.removeprefix(f"{table}.") in by_key:
            mine[by_key[name.removeprefix(f"{table}.")]] = rest.pop(key)
    return mine, rest


def check_section(cls: type, values: Mapping[str, Any], source: str = "config") -> None:
    """One-line ConfigError for the first section value (by flat name) of the wrong type; the values
    themselves are the feature's to check (its messages name the combinations it refuses)."""
    from pipewright.runtime.inputs import check_types

    by_flat = {flat_name(f): f for f in fields(cls)}
    check_types(cls, {by_flat[n].name: v for n, v in values.items() if n in by_flat}, source)


def read_section(cls: type, values: Mapping[str, Any]) -> Any:
    """Section ``cls`` built from flat-named ``values`` (a config's feature options), defaults for
    the options not given."""
    return cls(**{f.name: values.get(flat_name(f), _default(f)) for f in fields(cls)})


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    *,
    dest: Callable[[Field], str] = flat_name,
    group: str | None = None,
) -> None:
    """One argument group ``title`` with a flag per field of ``cls`` (those of help group ``group``
    when given; fields without a flag are skipped). Flags default to None (not given: the TOML value or
    the field's default holds); the help shows the field's default. ``dest``: the parsed value's name
    (default the flat name; the training config uses the field's own name)."""
    out = parser.add_argument_group(title)
    for f in fields(cls):
        meta = f.metadata
        if "flag" not in meta or (group is not None and meta.get("group") != group):
            continue
        default = _default(f)
        text = meta["help"]
        if "default" not in text and not meta["flag"].startswith("--no-"):
            text += f" (default: {'none' if default is None else default})"
        if _kind(f) is bool:
            action = "store_false" if meta["flag"].startswith("--no-") else "store_true"
            out.add_argument(meta["flag"], dest=dest(f), action=action, default=None, help=text)
            continue
        out.add_argument(
            meta["flag"], dest=dest(f), type=_kind(f), choices=meta.get("choices"), default=None, help=text
        )


def _kind(f: Field) -> type:
    """The scalar type of field ``f`` (``int | None`` → int), from its annotation."""
    if isinstance(f.type, type):
        return f.type if f.type in (bool, int, float) else str
    hint = str(f.type).replace(" ", "")
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if hint in (name, f"{name}|None"):
            return kind
    return str
