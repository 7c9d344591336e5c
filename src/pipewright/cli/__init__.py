"""``pipewright`` command line. Each subcommand lives in its own module with ``register(subparsers)``
that sets ``func`` on its parser; adding a command means adding its module to ``_COMMANDS``.

:func:`main` builds only the command it runs (the others are placeholders that argparse never
reaches), so ``pipewright simulate`` neither imports ``train``'s modules nor scans the installed
packages' entry points; no parser imports numpy, torch or matplotlib."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Sequence

from pipewright import __version__
from pipewright.errors import PipewrightError, ValidationError

_COMMANDS = ("schedule", "simulate", "train", "check", "profile", "plan", "export-plan", "data", "calibrate")


def build_parser(feature_paths: Sequence[str] = (), command: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``feature_paths``: ``--feature module:attr`` values, whose flags ``train`` adds;
    ``command``: build only this subcommand (the others are bare placeholders), or all when None."""
    from pipewright.cli._help import Parser
    from pipewright.runspec.flags import add_program_flags

    parser = Parser(
        prog="pipewright",
        description="Plan, simulate and run pipeline-parallel training of transformer models.",
    )
    add_program_flags(parser, f"pipewright {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name)
            continue
        module = importlib.import_module(f"pipewright.cli.{name.replace('-', '_')}")
        if name == "train":  # its flags depend on the features named on the command line
            module.register(sub, tuple(feature_paths))
        else:
            module.register(sub)
    return parser


@functools.cache
def _parser(feature_paths: tuple[str, ...] = (), command: str | None = None) -> argparse.ArgumentParser:
    """One parser per process, set of ``--feature`` values and command: in-process callers (tests, the
    CLI fuzzer) reuse it; argparse keeps no state between ``parse_args`` calls."""
    return build_parser(feature_paths, command)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option, the top level's options
    taking no value), or None (then the whole tree is built: ``pipewright --help``, a typo)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in _COMMANDS else None


def _feature_paths(argv: Sequence[str]) -> tuple[str, ...]:
    """The ``--feature X`` / ``--feature=X`` values of ``argv`` (read before the parser is built)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--feature" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--feature="):
            out.append(arg.partition("=")[2])
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _parser(_feature_paths(argv), _command(argv))
    except PipewrightError as exc:  # a --feature that does not load
        if getattr(exc, "details", None) and ("-v" in argv or "--verbose" in argv):
            print(exc.details, file=sys.stderr, end="")
        print(f"pipewright: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except ValidationError as exc:
        print(f"pipewright: error: {exc}", file=sys.stderr)
        return 2
    except PipewrightError as exc:  # on one line, each long value cut (a 100,000-character flag)
        from pipewright.outputs import shown

        print(f"pipewright: error: {' '.join(shown(w, 200) for w in str(exc).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`: not an error
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file the checks did not foresee (a name too long to look up …): one line
        from pipewright.outputs import shown

        where = f": {shown(exc.filename)}" if exc.filename else ""
        print(f"pipewright: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before or without workers (runtime/reliability/interrupts.py: a run)
        print("pipewright: interrupted", file=sys.stderr)
        return 130
