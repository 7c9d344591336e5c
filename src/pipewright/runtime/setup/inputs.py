"""Checks of values people write in files (TOML config): each value must have its field's type
(NaN/inf and ranges: pipewright.values), so a typo is a one-line error naming the key instead of a
traceback later."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping

from pipewright.errors import ConfigError

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _accepts(kind: type, value: object) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def check_types(cls: type, values: Mapping[str, object], source: str) -> None:
    """Raise a one-line ConfigError for the first ``values`` entry (field name → value) whose type is not
    the dataclass field's (``X | None`` also takes no value: TOML has no null). NaN/inf and
    ranges: :mod:`pipewright.values` (the same lines as on the command line)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints[name]
        kinds = (
            [a for a in typing.get_args(hint) if a is not type(None)]
            if isinstance(hint, types.UnionType)
            else [hint]
        )
        if not any(_accepts(k, value) for k in kinds):
            want = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(f"{source}: {name} must be {want}, not {shown}")
