"""Fuzzing every command's arguments: argument vectors drawn from each command's own argparse parser
(so flags added later are covered without listing them), with values at and beyond their limits,
wrong types, non-UTF-8 and missing files, unwritable output paths and huge sizes.

Each vector runs in-process (``pipewright.cli.main``) under a per-case time bound. Properties: no
traceback (every failure is a clean exit whose last stderr line is the one-line error), no run past
the bound, and no exit 0 when the vector holds a value that is nonsense for its flag. ``train`` always
gets ``--dry-run`` (every check, no worker; with a drawn ``--measure…`` flag, one step of each
distinct rank on meta tensors); ``plan`` and ``profile`` — whose valid runs search or
measure for a long time — get only vectors holding at least one nonsense value. Fixed seed
(``derandomize``); :data:`COUNTS` vectors per command, 2,160 in all.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import io
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipewright.training  # noqa: F401  (its cold import, torch's, is not counted in a vector's bound)
from pipewright.cli import build_parser, main
from pipewright.cli._help import parsers

BOUND_S = 10.0
COUNTS = {
    ("schedule", "show"): 250,
    ("schedule", "export"): 250,
    ("simulate",): 600,
    ("train",): 450,
    ("check",): 60,
    ("plan",): 300,
    ("profile",): 250,
    ("data", "prepare"): 60,
    ("export-plan",): 60,
    ("calibrate",): 60,
}
ONLY_NONSENSE = {("plan",), ("profile",), ("check",)}  # valid runs take minutes: stopped by a bad value
INPUT_WORDS = ("config", "profile", "plan", "topology", "schedule", "init_from", "data")
OUTPUT_WORDS = ("png", "trace", "out", "output")
#: int flags for which a negative value is a legitimate setting (none so far)
NEGATIVE_OK: set[str] = set()

VALID_INTS = ["1", "2", "3", "4", "8"]
EDGE_INTS = ["0"]
BAD_INTS = ["-1", "-4", "x", "1.5", "", "100000000000000000000000"]
HUGE_INTS = ["100000000"]
VALID_FLOATS = ["0.5", "1", "2", "1e-3"]
BAD_FLOATS = ["nan", "inf", "-inf", "-1", "x", ""]
WORDS = ["", "x", "none", "1f1b", "zb-h1", "gpt-tiny", "gpt3-175b", "cpu", "a100-80gb", "full", "é", "-"]


@dataclass
class Vector:
    argv: list[str]
    nonsense: list[str] = field(default_factory=list)  # why the vector is invalid (empty: may be valid)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "bad.bin").write_bytes(b"\xff\xfe\x00garbage\x80")
    (root / "bad.csv").write_bytes(b"0F0,\xff\n")
    (root / "empty.json").write_text("")
    (root / "folder").mkdir()
    (root / "blocker").write_text("a file where a folder should be")
    return {
        "non_utf8": str(root / "bad.bin"),
        "non_utf8_csv": str(root / "bad.csv"),
        "empty": str(root / "empty.json"),
        "folder": str(root / "folder"),
        "missing": str(root / "missing.json"),
        "unwritable": str(root / "blocker" / "x.out"),
        "writable": str(root / "out.file"),
        "root": str(root),
    }


def _leaves() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    found = {}
    for path, parser in parsers(build_parser()):
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            found[path] = parser
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._VersionAction)
    return [a for a in parser._actions if a.option_strings and not isinstance(a, skip)]


def _value(draw, action: argparse.Action, files: dict[str, str]) -> tuple[str, str | None]:
    """(value, why it is nonsense or None) for one option or positional."""
    name = action.dest
    if action.choices is not None:
        if draw(st.integers(0, 5)) == 0:
            return "bogus-choice", f"{name}: not a choice"
        return str(draw(st.sampled_from(sorted(map(str, action.choices))))), None
    if action.type is int:
        kind = draw(st.sampled_from(["valid"] * 4 + ["edge", "bad", "huge"]))
        if kind == "valid":
            return draw(st.sampled_from(VALID_INTS)), None
        if kind == "edge":
            return draw(st.sampled_from(EDGE_INTS)), None
        if kind == "huge":
            return draw(st.sampled_from(HUGE_INTS)), None
        value = draw(st.sampled_from(BAD_INTS))
        negative = value.startswith("-") and name in NEGATIVE_OK
        return value, None if negative else f"{name}={value!r}"
    if action.type is float:
        if draw(st.integers(0, 2)):
            return draw(st.sampled_from(VALID_FLOATS)), None
        value = draw(st.sampled_from(BAD_FLOATS))
        return value, f"{name}={value!r}"
    if any(w in name for w in OUTPUT_WORDS):
        if draw(st.booleans()):
            return files["unwritable"], f"{name}: unwritable"
        return files["writable"], None
    if any(w in name for w in INPUT_WORDS):
        key = draw(st.sampled_from(["non_utf8", "non_utf8_csv", "empty", "folder", "missing", "word"]))
        if key == "word":
            return draw(st.sampled_from(WORDS)), None
        return files[key], f"{name}: {key} file"
    return draw(st.sampled_from(WORDS)), None


def _vectors(path: tuple[str, ...], parser: argparse.ArgumentParser, files: dict[str, str]):
    options = _options(parser)
    positionals = [a for a in parser._actions if not a.option_strings]

    @st.composite
    def vector(draw) -> Vector:
        argv, nonsense = list(path), []
        for action in positionals:
            if draw(st.integers(0, 9)) == 0:
                continue  # a missing positional: argparse's usage error
            value, why = (
                _value(draw, action, files)
                if action.choices is not None or action.type
                else (draw(st.sampled_from(["1f1b", "gpipe", "zbv", "interleaved-1f1b", "nope"])), None)
            )
            argv.append(value)
            nonsense += [why] if why else []
        chosen = draw(st.lists(st.sampled_from(options), max_size=6, unique_by=id)) if options else []
        if path == ("train",):
            chosen = [a for a in chosen if "--dry-run" not in a.option_strings]
        for action in chosen:
            longs = [f for f in action.option_strings if f.startswith("--")] or action.option_strings
            flag = draw(st.sampled_from(longs))
            if action.nargs == 0:
                argv.append(flag)
                continue
            value, why = _value(draw, action, files)
            argv.append(f"{flag}={value}")  # '=' keeps values such as '-1' attached to their flag
            nonsense += [why] if why else []
        if path == ("train",):
            argv.append("--dry-run")
        if path in ONLY_NONSENSE and not nonsense:
            action = draw(st.sampled_from([a for a in options if a.type in (int, float)]))
            argv.append(f"{next(f for f in action.option_strings if f.startswith('--'))}=nan")
            nonsense.append(f"{action.dest}=nan")
        return Vector(argv, nonsense)

    return vector()


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def _run(vector: Vector) -> None:
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(vector.argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    except _Timeout:
        pytest.fail(f"ran past {BOUND_S:g} s: pipewright {' '.join(vector.argv)}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    text = err.getvalue().strip()
    assert "Traceback" not in text, f"pipewright {' '.join(vector.argv)}\n{text}"
    if code != 0:
        last = text.splitlines()[-1] if text else ""
        assert "error:" in last, f"exit {code} without a one-line error: {' '.join(vector.argv)}\n{text}"
    assert not (code == 0 and vector.nonsense), (
        f"exit 0 for nonsense ({'; '.join(vector.nonsense)}): pipewright {' '.join(vector.argv)}"
    )


@functools.cache
def _entry_points(**selection: str) -> importlib.metadata.EntryPoints:
    """The installed entry points, scanned once: no package is installed while the vectors run, and
    each command looks up its plugins (a scan of every installed distribution, ~0.1 s) per call."""
    return _ENTRY_POINTS(**selection)


_ENTRY_POINTS = importlib.metadata.entry_points


@pytest.mark.parametrize("path", sorted(COUNTS), ids=" ".join)
def test_cli_fuzz(path, files, tmp_path, monkeypatch) -> None:
    leaves = _leaves()
    assert set(COUNTS) <= set(leaves), f"commands without a fuzz count: {set(leaves) - set(COUNTS)}"
    monkeypatch.chdir(tmp_path)  # default outputs (runs/…) land in a scratch folder
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points)
    if path == ("train",):  # torch's first import (seconds under load) is not the command's work
        import pipewright.training  # noqa: F401

    @settings(
        max_examples=COUNTS[path],
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_vectors(path, leaves[path], files))
    def check(vector: Vector) -> None:
        ran.append(vector)
        _run(vector)

    ran: list[Vector] = []
    check()
    assert len(ran) >= COUNTS[path]  # the count is met, not just bounded


def test_every_command_is_fuzzed() -> None:
    assert set(_leaves()) == set(COUNTS)
    assert sum(COUNTS.values()) >= 2000
    assert Path(__file__).name == "test_cli_fuzz.py"
