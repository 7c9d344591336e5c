"""The command line's parser class and a walk over its tree.

Every flag's help, with its default, is the RunSpec's (:mod:`pipewright.runspec.flags`, which holds
every flag declaration of the command line); :class:`Parser` makes a usage error one line and
:func:`parsers` yields every parser of the tree (the tests check each flag's help there).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import NoReturn


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with its command path (``("schedule", "show")``), depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage error is one line (the usage itself is ``--help``'s), with a long
    value cut."""

    def error(self, message: str) -> NoReturn:
        from pipewright.outputs import shown

        words = " ".join(shown(w, 120) for w in message.split(" "))
        self.exit(2, f"{self.prog}: error: {words} (see {self.prog} --help)\n")
