"""The one place a RunSpec is checked: every value against its field's type (closed choices
included), numbers finite and at least their field's minimum (0 unless declared), the layout in
Megatron-Core's language fitting the model and pp × virtual, and the pairs of options that exclude each
other. Each refusal is one line naming the TOML key and the flag. Pure Python.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import Field
from typing import Any

from pipewright.errors import ConfigError
from pipewright.runspec.fields import base_type, choices, optional
from pipewright.runspec.run import Path, RunSpec, get, spec_fields

#: Options that exclude each other (both switched on is refused), each with why where the reason is not
#: plain (a command line meets those in the command's own check, which says the same).
EXCLUSIVE: dict[tuple[Path, Path], str] = {
    (("memory", "shard_optimizer"), ("memory", "fsdp")): "",
    (("parallelism", "sequence_parallel"), ("parallelism", "scatter_gather")): (
        "scatter-gather needs identical stage outputs on the tp ranks, which sequence parallelism splits"
    ),
}


def _accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` is of type ``kind`` (a float field takes an integer)."""
    if value is None:
        return optional(kind)
    base = base_type(kind)
    listed = choices(kind)
    if listed is not None:
        return value in listed
    if base == bool | str:
        return isinstance(value, bool | str)
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        return isinstance(value, tuple) and all(_accepts(item, x) for x in value)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _want(kind: Any) -> str:
    listed = choices(kind)
    if listed is not None:
        return "one of " + ", ".join(map(str, listed))
    base = base_type(kind)
    if typing.get_origin(base) is tuple:
        return f"a list of {typing.get_args(base)[0].__name__}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(base, str(base))


def _where(path: Path, f: Field | None, source: str) -> str:
    flag = f" ({f.metadata['flag']})" if f is not None and f.metadata.get("flag") else ""
    return f"{source}: {'.'.join(path)}{flag}"


def check_types(given: Mapping[Path, tuple[Any, Any]], source: str, fields: Mapping | None = None) -> None:
    """One-line ConfigError for the first value (path → (type, value)) not of its type."""
    for path, (kind, value) in given.items():
        if not _accepts(kind, value):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            f = (fields or {}).get(path)
            raise ConfigError(f"{_where(path, f, source)} must be {_want(kind)}, not {shown}")


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, tuple):
        return [x for x in value if isinstance(x, int | float) and not isinstance(x, bool)]
    return []


def validate(spec: RunSpec, source: str = "run spec") -> RunSpec:
    """``spec`` when every check holds; else a one-line ConfigError naming the key and flag."""
    features = {n: type(s) for n, s in spec.features.items()}
    fields = {p: (f, kind) for p, f, kind in spec_fields(features)}
    for path, (f, kind) in fields.items():
        value = get(spec, path)
        check_types({path: (kind, value)}, source, {path: f})
        floor = f.metadata.get("minimum")
        floor = 0 if floor is None else floor
        for x in _numbers(value):
            if not math.isfinite(x):
                raise ConfigError(f"{_where(path, f, source)} must be finite, not {x}")
            if x < floor:
                raise ConfigError(f"{_where(path, f, source)} must be at least {floor}, not {x}")
        allowed = f.metadata.get("choices")  # a feature option's closed choices (pipewright.options)
        variants = [v.get("choices") for v in f.metadata.get("variants", {}).values()]
        if allowed and value is not None and value not in {*allowed, *(c for v in variants if v for c in v)}:
            raise ConfigError(f"{_where(path, f, source)} must be one of {', '.join(allowed)}, not {value!r}")
    for (a, b), why in EXCLUSIVE.items():
        if get(spec, a) and get(spec, b):
            first, second = _where(a, fields[a][0], source), _where(b, fields[b][0], "")
            reason = f" ({why})" if why else ""
            raise ConfigError(f"{first} and{second.removeprefix(':')} exclude each other{reason}")
    _check_layout(spec, source)
    return spec


def _check_layout(spec: RunSpec, source: str) -> None:
    """The layout parses (Megatron-Core's language) and, where the spec gives them, holds the model's
    layers and multi-token-prediction layers in pp × virtual stages."""
    text = spec.parallelism.layout
    if not text:
        return
    from pipewright.models.layout import parse_layout

    try:
        layout = parse_layout(text)
        p, v = spec.parallelism.pp, spec.parallelism.virtual
        layout.check(
            spec.model.layers if spec.model.layers is not None else layout.num_layers,
            p * (v or 1) if p is not None and v is not None else None,
            spec.model.mtp_depth,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: parallelism.layout (--layout): {exc}") from None
