"""Option sections: a feature's options as one frozen dataclass, whose field metadata gives each
option's command-line flag, help, choices, the commands that take it and whether it changes the
update rule.

One declaration serves every reader: the TOML file (a ``[table]`` named for the section, keys named
like the fields, or the flag's name in ``[train]``), the command lines of ``train``, ``simulate`` and
``plan`` (the run spec's ``features.<name>`` section: :func:`pipewright.runspec.add_spec_flags` gives
it one argument group per command, defaults shown) and the code
that reads the values (:func:`read_section`). A field lists the commands that take it (``commands``,
default ``("train",)``) and may give a command its own choices, help or default (``variants``:
``simulate --vocab-parallel`` also takes ``redistribute``). A training value is stored in
:class:`~pipewright.runtime.setup.config.TrainConfig` under its *flat name*, the flag without its dashes
(``--kfac-base`` → ``kfac_base``), so a run's ``config.json`` and checkpoints record every option
under the name its flag has; the other commands parse it under the same name. Only the fields of
``train`` belong to the TOML table and the config. Pure Python: importing a section imports no
numpy, torch or matplotlib.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any

from pipewright.values import check_types

#: The commands whose flags come from option sections.
COMMANDS = ("train", "simulate", "plan")
#: What a field may set differently for one command (``variants``).
_VARIANT_KEYS = frozenset({"choices", "help", "default"})


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    update_rule: bool = False,
    group: str = "",
    commands: tuple[str, ...] = ("train",),
    variants: Mapping[str, Mapping[str, Any]] | None = None,
) -> Any:
    """A section field: ``flag`` (``--name``; ``--no-name`` for a switch that turns a True default
    off), ``help``, ``choices``; ``update_rule``: the option changes which per-parameter optimizer
    state a run keeps (a resume with another value is refused); ``group``: the help group it is listed
    under (the training config's fields); ``commands``: the commands that take the flag (of
    :data:`COMMANDS`); ``variants``: command → its own ``choices``/``help``/``default``."""
    for command in commands:
        if command not in COMMANDS:
            raise ValueError(f"option {flag}: unknown command {command!r}; known: {', '.join(COMMANDS)}")
    variants = {k: dict(v) for k, v in (variants or {}).items()}
    for command, variant in variants.items():
        if command not in commands or not set(variant) <= _VARIANT_KEYS:
            raise ValueError(
                f"option {flag}: a variant for {command!r} must be of a listed command "
                f"and set only {', '.join(sorted(_VARIANT_KEYS))}"
            )
    meta = {
        "flag": flag,
        "help": help,
        "choices": choices,
        "update_rule": update_rule,
        "group": group,
        "commands": tuple(commands),
        "variants": variants,
    }
    return field(default=default, metadata=meta)


def flat_name(f: Field) -> str:
    """The name a section field is stored under: its flag without dashes (``--kfac-base`` → ``kfac_base``)."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def fields_for(cls: type, command: str = "train") -> tuple[Field, ...]:
    """The fields of section ``cls`` that ``command`` takes (fields without a flag belong to none)."""
    return tuple(f for f in fields(cls) if command in f.metadata.get("commands", ()))


def flat_defaults(cls: type, command: str = "train") -> dict[str, Any]:
    """Every option of section ``cls`` that ``command`` takes, with its default (that command's
    variant), by flat name."""
    return {flat_name(f): _default(f, command) for f in fields_for(cls, command)}


def update_rule_names(cls: type) -> tuple[str, ...]:
    """Flat names of the section's training options that change the optimizer's update rule."""
    return tuple(flat_name(f) for f in fields_for(cls) if f.metadata.get("update_rule"))


def _default(f: Field, command: str = "train") -> Any:
    variant = f.metadata.get("variants", {}).get(command, {})
    if "default" in variant:
        return variant["default"]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"option {f.name} has no default")


def take_values(cls: type, table: str, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``values`` (flat name, or ``"table.key"`` from a TOML ``[table]``) into the options of
    section ``cls`` (by flat name, defaults filled in) and the rest. A ``[table]`` key may use dashes."""
    mine, rest = flat_defaults(cls), dict(values)
    by_key = {f.name: flat_name(f) for f in fields_for(cls)}
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
    by_flat = {flat_name(f): f for f in fields_for(cls)}
    check_types(cls, {by_flat[n].name: v for n, v in values.items() if n in by_flat}, source)


def read_section(cls: type, values: Mapping[str, Any], command: str = "train") -> Any:
    """Section ``cls`` built from flat-named ``values`` (a config's feature options, or a command's
    parsed options) for ``command``: its fields from ``values`` (their default when not given), every
    other field at its default."""
    mine = {f.name for f in fields_for(cls, command)}
    return cls(
        **{
            f.name: values.get(flat_name(f), _default(f, command)) if f.name in mine else _default(f)
            for f in fields(cls)
        }
    )


def section_of(config: Any, cls: type) -> Any:
    """The options section of type ``cls`` among a training config's ``features`` (by feature name), its
    defaults when the config holds none."""
    found = next((s for s in config.features.values() if type(s) is cls), None)
    return cls() if found is None else found
