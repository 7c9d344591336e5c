"""A RunSpec as TOML: one ``[table]`` per section (``[parallelism]``, ``[model.moe]``,
``[features.vocab]``), keys named as the fields.

:func:`dump_toml` writes every value that is not None (TOML has no null: a key left out is the
command's default); :func:`load_toml` starts from the command's defaults, sets each key the file has,
and refuses an unknown table or key, or a value of the wrong type, with one line that names it
(:func:`pipewright.runspec.validation.validate`). Pure Python (``tomllib``; the writer is this module's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any

import tomllib

from pipewright.errors import ConfigError
from pipewright.runspec.fields import base_type
from pipewright.runspec.run import Path, RunSpec, defaults, feature_sections, get, spec_fields, with_values
from pipewright.runspec.validation import check_types, validate


def _value(value: Any) -> str:
    """A TOML value: string (basic, escaped), integer, float, boolean or array."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_value(x) for x in value) + "]"
    raise ConfigError(f"cannot write a {type(value).__name__} to TOML")


def dump_toml(spec: RunSpec) -> str:
    """``spec`` as TOML text (tables in declaration order, None values left out)."""
    features = {n: type(s) for n, s in spec.features.items()}
    tables: dict[Path, list[str]] = {}
    for path, _, _ in spec_fields(features):
        value = get(spec, path)
        if value is not None:
            tables.setdefault(path[:-1], []).append(f"{path[-1]} = {_value(value)}")
    return "\n".join(f"[{'.'.join(t)}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())


def _flatten(table: Mapping[str, Any], path: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, (*path, key)))
        else:
            out[(*path, key)] = tuple(value) if isinstance(value, list) else value
    return out


def load_toml(
    source: str | FilePath, command: str | None = None, features: Mapping[str, type] | None = None
) -> RunSpec:
    """The RunSpec of a TOML file (a path) for ``command``: its defaults, then the file's values;
    checked (:func:`~pipewright.runspec.validation.validate`). One-line ConfigError for a file that
    does not read, an unknown key, or a bad value."""
    path = FilePath(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise ConfigError(f"{path} is empty; a run spec has the tables of docs/run-spec.md")
    return loads_toml(text, command, features, source=str(path))


def loads_toml(
    text: str,
    command: str | None = None,
    features: Mapping[str, type] | None = None,
    source: str = "run spec",
) -> RunSpec:
    """:func:`load_toml` of TOML text."""
    features = feature_sections() if features is None else features
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not TOML: {exc}") from None
    known = {p: (f, kind) for p, f, kind in spec_fields(features)}
    given = _flatten(data)
    for key in given:
        if key not in known:
            raise ConfigError(f"{source}: unknown key {'.'.join(key)}; see docs/run-spec.md for the sections")
    check_types({k: (known[k][1], v) for k, v in given.items()}, source, {k: known[k][0] for k in given})
    floats = {k: float(v) for k, v in given.items() if base_type(known[k][1]) is float and v is not None}
    spec = with_values(defaults(command, features), given | floats)
    validate(spec, source=source)
    return spec
