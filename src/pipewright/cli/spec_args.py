"""A command's parser generated from the RunSpec's fields, and a parsed command line as its RunSpec
(docs/run-spec.md).

:func:`add_command` adds a command whose flags are the spec's (:func:`pipewright.runspec.add_spec_flags`:
``--config RUN.toml``, one help group per section, every default shown). Its parsed namespace is
:func:`spec_namespace`'s: the command's RunSpec as ``args.spec`` (its defaults, then the ``--config``
file, then the flags given), read by its typed sections (``args.spec.parallelism.pp``), and the paths
of the flags given as ``args.given``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from pipewright.errors import ConfigError


def add_command(
    sub: argparse._SubParsersAction,
    command: str,
    run: Callable[[argparse.Namespace], int],
    features: Mapping[str, type] | None = None,
    **parser_options: Any,
) -> argparse.ArgumentParser:
    """Subcommand ``command`` with the spec's flags for it, whose parsed namespace is
    :func:`spec_namespace`'s (and ``func`` is ``run``)."""
    from pipewright.runspec import add_spec_flags

    parser = sub.add_parser(command.rpartition(" ")[2], **parser_options)  # (schedule show: "show")
    add_spec_flags(parser, command, features)
    parser.set_defaults(func=run)
    plain = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = plain(args, namespace)
        _exclusive(parser, parsed)
        try:
            return spec_namespace(parsed, command, features), rest
        except ConfigError as exc:  # (a --config file that does not read): the command's one line
            return argparse.Namespace(**{**vars(parsed), "func": _raises(exc)}), rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


def required(command: str, **values: Any) -> None:
    """argparse's usage error (exit status 2) when a required argument is in neither the flags nor
    the ``--config`` file: ``required("plan", **{"--global-batch-size": args.global_batch_size})``."""
    import sys

    missing = [name for name, value in values.items() if value is None]
    if missing:
        print(
            f"pipewright {command}: error: the following arguments are required: {', '.join(missing)} "
            f"(see pipewright {command} --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _exclusive(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> None:
    """argparse's usage error for two flags given that exclude each other (``--shard-optimizer`` and
    ``--fsdp``: :data:`pipewright.runspec.validation.EXCLUSIVE`)."""
    from pipewright.runspec.validation import EXCLUSIVE

    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for pair, why in EXCLUSIVE.items():
        if why:  # the command's own check refuses it with the reason
            continue
        first, second = (".".join(p) for p in pair)
        if getattr(parsed, first, False) and getattr(parsed, second, False):
            parser.error(f"argument {flags[second]}: not allowed with argument {flags[first]}")


def _beside(spec: Any, config: str) -> Any:
    """``spec`` with its file's ``parallelism.plan`` (a search report) read beside that file."""
    from pathlib import Path

    from pipewright.runspec import with_values

    plan = spec.parallelism.plan
    if plan is None or Path(plan).is_absolute():
        return spec
    return with_values(spec, {("parallelism", "plan"): str(Path(config).parent / plan)})


def _raises(exc: Exception) -> Callable[[argparse.Namespace], int]:
    def fail(args: argparse.Namespace) -> int:
        raise exc

    return fail


def is_run_spec(path: str) -> bool:
    """Whether the TOML file at ``path`` is a RunSpec (every top-level key one of its tables), not a
    ``train`` file of flat keys or a ``[train]`` table (read by
    :func:`~pipewright.training.run_inputs.toml_values`). A file that does not read: True (the
    RunSpec reader's one-line error names it)."""
    import dataclasses

    import tomllib

    from pipewright.runspec import RunSpec

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True
    tables = {f.name for f in dataclasses.fields(RunSpec)}
    return all(isinstance(v, dict) and k in tables for k, v in data.items())


def spec_namespace(
    args: argparse.Namespace, command: str, features: Mapping[str, type] | None = None
) -> argparse.Namespace:
    """The RunSpec of parsed ``args`` as ``spec`` (its defaults, the ``--config`` file, the flags given),
    the paths of the flags given as ``given``, and the namespace's other keys (``func``). ``train`` and
    ``check`` also read an older ``train`` TOML (flat keys or ``[train]``): its path as ``train_toml``
    (None when ``--config`` is a RunSpec or not given), the spec then from the flags alone."""
    from pipewright.runspec import spec_from_args
    from pipewright.runspec.fields import TRAINING

    given = vars(args)
    out: dict[str, Any] = {k: v for k, v in given.items() if "." not in k and k != "config"}
    if command in TRAINING:
        out["train_toml"] = None
    if command in TRAINING and "config" in given and not is_run_spec(given["config"]):
        out["train_toml"] = given["config"]
        args = argparse.Namespace(**{k: v for k, v in given.items() if k != "config"})
    spec = spec_from_args(args, command, features, check=False)  # the command's checks name the flags
    if out.get("train_toml") is None and "config" in given and "parallelism.plan" not in given:
        spec = _beside(spec, given["config"])
    flagged = frozenset(tuple(k.split(".")) for k in given if "." in k)
    return argparse.Namespace(**out, spec=spec, given=flagged)


def flag_values(spec: Any, command: str) -> dict[str, Any]:
    """Each value of a field ``command`` takes, by its flag (``{"--tp": 2, …}``): what a check's
    one-line error names."""
    from pipewright.runspec.run import field_takes, get, spec_fields

    known = {n: type(s) for n, s in spec.features.items()}
    return {
        f.metadata["flag"]: get(spec, path)
        for path, f, _ in spec_fields(known)
        if f.metadata["flag"] and field_takes(path, f, command)
    }
