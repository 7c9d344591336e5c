"""Help text for every flag of every command, applied once to the finished parser tree.

:func:`document` walks the parser and each subparser (so flags added by any module or feature are
covered): every option gets a help line, its default (``train``'s defaults are
:class:`~pipewright.runtime.setup.config.TrainConfig`'s, since its flags default to None = "not given"), and
list-valued options say that they take commas. ``train``'s defaults are read only when help is printed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

#: words in a flag name that mark a comma-separated value (as does a default holding a comma)
_LIST_WORDS = ("sizes", "placement")


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with its command path (``("schedule", "show")``), depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


class _LazyDefault:
    """A default read only when help is printed (``train``'s come from TrainConfig, whose import would
    load the runtime package — and torch — for every command)."""

    def __init__(self, dest: str, defaults: Callable[[], Mapping[str, object]]) -> None:
        self.dest, self.defaults = dest, defaults

    def __str__(self) -> str:
        value = self.defaults().get(self.dest)
        return _none_means(self.dest) if value is None else str(value)


def _spec_default(dest: str) -> object:
    from dataclasses import fields

    from pipewright.models.spec import ModelSpec

    return next((f.default for f in fields(ModelSpec) if f.name == dest), None)


def _none_means(dest: str) -> str:
    """What a model-shape flag left out means: the preset's value, else the model's default (``--moe-top-k``
    left out routes to 2 experts, not none)."""
    if dest.startswith("moe_"):
        default = _spec_default(dest)
        if default is not None:
            return f"the preset's, else {default}"
    return "none"


class _LazyPresets:
    """The model presets, the mixture-of-experts ones named as such (read only when help is printed)."""

    def __str__(self) -> str:
        from pipewright.models.presets import PRESETS

        dense = [n for n, s in PRESETS.items() if not s.moe_experts]
        moe = [n for n, s in PRESETS.items() if s.moe_experts]
        return f"presets: {', '.join(dense)}; mixture of experts: {', '.join(moe)}"


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage error is one line (the usage itself is ``--help``'s), with a long
    value cut."""

    def error(self, message: str) -> NoReturn:
        from pipewright.outputs import shown

        words = " ".join(shown(w, 120) for w in message.split(" "))
        self.exit(2, f"{self.prog}: error: {words} (see {self.prog} --help)\n")


def _default_text(action: argparse.Action, defaults: Callable[[], Mapping[str, object]] | None) -> str | None:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return None  # a switch: off unless given
    value = action.default
    if value is None and defaults is not None:
        action.lazy_default = _LazyDefault(action.dest, defaults)  # argparse formats help with vars(action)
        return "default: %(lazy_default)s"
    if value is None and action.dest.startswith("moe_"):
        return f"default: {_none_means(action.dest)}"
    if value is None or value is argparse.SUPPRESS:
        return "default: none" if action.option_strings else None
    return f"default: {value}".replace("%", "%%")


def document(
    parser: argparse.ArgumentParser, train_defaults: Callable[[], Mapping[str, object]] | None = None
) -> None:
    """Give every option of the tree a help line that states its default and, for list values, the
    separator; set a formatter that keeps the lines as written."""
    for path, sub in parsers(parser):
        defaults = train_defaults if path[:1] == ("train",) else None
        for action in sub._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            text = action.help or action.dest.replace("_", " ")
            if action.dest.startswith("moe_") and text.endswith("(default: none)"):  # train's, from options
                text = text.removesuffix("(default: none)") + f"(default: {_none_means(action.dest)})"
            notes = []
            if action.dest == "model" and "presets:" not in text:
                action.model_presets = _LazyPresets()  # argparse formats help with vars(action)
                notes.append("%(model_presets)s")
            flag = action.option_strings[-1]
            listed = isinstance(action.default, str) and "," in action.default
            said = "comma" in text.lower() or "separated" in text.lower()
            if (listed or any(w in flag for w in _LIST_WORDS)) and not said:
                notes.append("comma-separated")
            if "default" not in text.lower():
                shown = _default_text(action, defaults)
                if shown is not None:
                    notes.append(shown)
            action.help = text + (f" ({'; '.join(notes)})" if notes else "")
