"""A command's flags, generated from the RunSpec's fields, and back: :func:`add_spec_flags` (one
argument group per section, every default shown), :func:`spec_from_args` (the ``--config`` file, then
the flags given over it) and :func:`spec_to_argv` (the flags that rebuild a spec); and the program's
own ``--version`` and ``--verbose`` (:func:`add_program_flags`). Every ``add_argument`` of the command
line is here.

A flag's destination is its field's path (``parallelism.tp``) and its parsed default is
``argparse.SUPPRESS``: the namespace holds exactly the flags given, so flags override the file and
the file overrides the defaults. Pure Python.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field
from typing import Any

from pipewright.errors import ConfigError
from pipewright.runspec.fields import base_type, choices, setting, subsections
from pipewright.runspec.run import (
    DESCRIPTIONS,
    Path,
    RunSpec,
    defaults,
    feature_sections,
    field_command,
    field_default,
    field_takes,
    get,
    spec_fields,
    values,
    with_values,
)
from pipewright.runspec.toml_io import load_toml
from pipewright.runspec.validation import validate

#: The most flags one help group shows (a larger section is split into sub-sections).
MAX_GROUP = 15


def _title(path: Path, cls: type) -> str:
    """``model.moe: Mixture of experts: …`` (a feature's group: ``features.vocab``)."""
    if path[0] == "features":  # the feature's name and description, as the feature states them
        why = DESCRIPTIONS.get(cls, "")
        return f"{path[-1]}: {why}" if why else ".".join(path)
    doc = " ".join((cls.__doc__ or "").split("(``", 1)[0].split())
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")  # (a Sphinx role's text alone)
    return f"{'.'.join(path)}: {doc.rstrip('.')}" if doc else ".".join(path)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):  # a bare flag or a mode (--tp-comm-overlap): off until given
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def switch_clears(path: Path, flag: str) -> bool:
    """Whether the switch ``flag`` sets the field at ``path`` to False: a ``--no-…`` flag does, unless
    the field is named as the flag (``--no-progress`` clears ``output.progress``; ``--no-step-barrier``
    sets ``simulation.no_step_barrier``)."""
    return flag.startswith("--no-") and path[-1] != flag[2:].replace("-", "_")


def _switch(path: Path, flag: str, value: bool) -> str:
    """A switch's default as on or off (``--no-progress``: off while progress is on)."""
    return "on" if value != switch_clears(path, flag) else "off"


def _commas(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        return tuple(kind(x) for x in text.split(",") if x)

    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def _scalar(kind: Any) -> Callable[[str], Any]:
    """The argparse ``type`` of a scalar annotation (a Literal's element type)."""
    listed = choices(kind)
    if listed:
        return type(listed[0])
    kind = base_type(kind)
    return kind if kind in (int, float) else str


def _add(group: Any, path: Path, f: Field, kind: Any, command: str) -> None:
    """One flag of field ``f`` on ``group``, for ``command``."""
    cmd = field_command(path, command)
    flag = f.metadata["flag"]
    names = (flag, *(setting(f, cmd, "aliases") or ()))
    text = setting(f, cmd, "help") or path[-1].replace("_", " ")
    value = field_default(path, f, command)
    text = text.replace("%(default)s", _shown(value))
    if "default" not in text.lower():
        text += f" (default: {_switch(path, flag, value) if base_type(kind) is bool else _shown(value)})"
    common = {"dest": ".".join(path), "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
    metavar = path[-1].upper()
    base = base_type(kind)
    positional = setting(f, cmd, "positional")
    nargs = f.metadata.get("nargs")
    if positional:  # (export-plan PLAN, data prepare INPUT …): the argument in place of the flag
        many = "*" if nargs == "+" else "?"  # optional here: a --config file may give it instead
        group.add_argument(common.pop("dest"), metavar=positional, nargs=many, **common)
        return
    if base is bool:
        action = "store_false" if switch_clears(path, flag) else "store_true"
        group.add_argument(*names, action=action, **common)
    elif kind == bool | str:  # a bare flag (True) or a mode
        group.add_argument(*names, nargs="?", const=True, metavar="MODE", **common)
    elif getattr(base, "__origin__", None) is tuple:
        item = base.__args__[0]
        if nargs == "append":
            group.add_argument(*names, action="append", type=item, metavar=metavar, **common)
        elif nargs == "+":
            group.add_argument(*names, nargs="+", type=item, metavar=metavar, **common)
        else:
            group.add_argument(*names, type=_commas(item), metavar="X,…", **common)
    else:
        listed = setting(f, cmd, "choices") or choices(kind)
        group.add_argument(
            *names, type=_scalar(kind), choices=listed, metavar=None if listed else metavar, **common
        )


def add_program_flags(parser: argparse.ArgumentParser, version: str) -> None:
    """The program's own flags, before its command: ``--version`` and ``-v``/``--verbose``."""
    parser.add_argument("--version", action="version", version=version, help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details (default: off)")


def add_spec_flags(
    parser: argparse.ArgumentParser, command: str, features: Mapping[str, type] | None = None
) -> None:
    """``--config RUN.toml`` and every flag ``command`` takes, one argument group per section
    (``model``, ``model.moe``, …, ``features.vocab``), each help line with its default."""
    features = feature_sections() if features is None else features
    parser.add_argument(
        "--config",
        metavar="RUN.toml",
        default=argparse.SUPPRESS,
        help="a RunSpec TOML file; the flags given override it (default: none)",
    )
    fields = list(spec_fields(features))
    sections: list[tuple[Path, type]] = list(subsections(RunSpec))[1:]
    sections += [(("features", name), cls) for name, cls in features.items()]
    for path, cls in sections:
        mine = [(p, f, k) for p, f, k in fields if p[:-1] == path and field_takes(p, f, command)]
        if mine:
            group = parser.add_argument_group(_title(path, cls))
            for p, f, kind in mine:
                _add(group, p, f, kind, command)


def spec_from_args(
    args: argparse.Namespace, command: str, features: Mapping[str, type] | None = None, check: bool = True
) -> RunSpec:
    """The RunSpec of a parsed command line: ``command``'s defaults, then the ``--config`` file's
    values, then the flags given (``check``: :func:`validate` them; False where the command's own
    checks name the flags)."""
    features = feature_sections() if features is None else features
    given = vars(args)
    base = load_toml(given["config"], command, features) if "config" in given else defaults(command, features)
    known = {".".join(p): p for p, _, _ in spec_fields(features)}
    changes = {
        known[dest]: tuple(v) if isinstance(v, list) else v for dest, v in given.items() if dest in known
    }
    spec = with_values(base, changes)
    return validate(spec, source="command line") if check else spec


def spec_to_argv(spec: RunSpec, command: str, features: Mapping[str, type] | None = None) -> list[str]:
    """Flags of ``command`` that rebuild ``spec`` from ``command``'s defaults (each value that differs
    from its default). One-line ConfigError for a value no flag can write (None over a default, a
    switch's off state over an on default, a field the command does not take)."""
    features = {n: type(s) for n, s in spec.features.items()} if features is None else features
    start = values(defaults(command, features), features)
    argv: list[str] = []
    words: list[str] = []  # the positional argument's, last
    for path, f, kind in spec_fields(features):
        value = get(spec, path)
        if value == start[path] and type(value) is type(start[path]):
            continue
        flag = f.metadata["flag"]
        where = f"{'.'.join(path)} = {value!r}"
        if not field_takes(path, f, command):
            raise ConfigError(f"{where}: {command} takes no {flag or 'flag for it (TOML only)'}")
        if value is None:
            raise ConfigError(
                f"{where}: {flag} cannot say 'none' (its default for {command} is {start[path]})"
            )
        if setting(f, field_command(path, command), "positional"):
            words = _positional(value, where)
            continue
        argv += _words(path, flag, value, base_type(kind), f.metadata.get("nargs"), where)
    # after "--" a word that starts with "-" is the argument's, not a flag (or a flag's abbreviation)
    return argv + (["--", *words] if any(w.startswith("-") for w in words) else words)


def _positional(value: Any, where: str) -> list[str]:
    words = list(map(str, value)) if isinstance(value, tuple) else [str(value)]
    if not words:
        raise ConfigError(f"{where}: the argument needs at least one value")
    if "--" in words:
        raise ConfigError(f"{where}: argparse reads '--' as the end of the options; no argument can be it")
    return words


def _words(path: Path, flag: str, value: Any, base: Any, nargs: str | None, where: str) -> Sequence[str]:
    if value == "--" or (isinstance(value, tuple) and "--" in value):
        raise ConfigError(f"{where}: argparse reads '--' as the end of the options; no flag can write it")
    if value is True or value is False:
        if (value is False) != switch_clears(path, flag):
            raise ConfigError(f"{where}: the switch {flag} cannot write it")
        return [flag]
    if isinstance(value, tuple):
        if nargs == "append":
            return [f"{flag}={x}" for x in value]
        if nargs == "+":
            if not value:
                raise ConfigError(f"{where}: {flag} needs at least one value")
            return [flag, *map(str, value)]
        return [f"{flag}={','.join(map(str, value))}"]
    return [f"{flag}={value!r}" if isinstance(value, float) else f"{flag}={value}"]
