"""The project states what holds, not how it was made.

Docs, benchmarks, tools, tests and the package's docstrings and comments say what the code does and
what was measured (with the date, the machine, its load and the command); they do not speak of periods
of work ("session 5"), roles ("the lead", helper agents), branches or worktrees of the process, issue
numbers, or "other jobs on the machine". Each pattern below names such wording precisely enough that
the code terms it resembles (a helper thread, the ``lead`` dimensions of a tensor, a code branch, the
issue order of collectives, a profile that is not re-measured) pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What is scanned: files, or folders searched recursively for these suffixes.
SCANNED = ("BENCHMARKS.md", "README.md", "docs", "src", "tools", "benchmarks", "tests")
SUFFIXES = {".md", ".py", ".toml", ".txt", ".rst"}

_I = re.IGNORECASE
#: (pattern, what it catches).
PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bsessions?\b", _I), "a period of work or a session of the process"),
    (re.compile(r"\bthis period\b|\bperiods? of work\b", _I), "a period of work"),
    (re.compile(r"\b(?:the|a) lead(?:'s)?\b(?! (?:to|time)\b)", _I), "a role (the lead)"),
    (re.compile(r"\blead's\b", _I), "a role (the lead)"),
    (re.compile(r"\bhelpers? (?:sessions?|engineers?|agents?|ran|running|were)\b", _I), "a role (helpers)"),
    (re.compile(r"\b(?:two|three|several|other) helpers\b", _I), "a role (helpers)"),
    (re.compile(r"\bengineers?\b", _I), "a role (engineers)"),
    (re.compile(r"\bworktrees?\b", _I), "a worktree of the process"),
    (re.compile(r"\bon (?:this|that|the|its|a) (?:`[\w./-]+` )?branch\b", _I), "a branch of the process"),
    (re.compile(r"\bmerge branch\b|\bbefore (?:its|the) merge\b", _I), "a branch of the process"),
    (re.compile(r"\bother (?:jobs|sessions?|helpers|engineers)\b", _I), "other jobs on the machine"),
    (re.compile(r"\bre-?measured by\b|\bre-?measurements\b", _I), "who re-measured what"),
    (re.compile(r"\bissues? #?\d+\b", _I), "an issue number of the tracker"),
    (re.compile(r"\bthe issue's\b|\bthe issue (?:asks|asked|says)\b", _I), "the issue's wording"),
    (re.compile(r"\bacceptance\b", _I), "the issue's acceptance wording"),
    (re.compile(r"\blent to\b|\bthis task\b", _I), "the task of the process"),
)


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, what the pattern catches, the matched words) for every hit in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, what in PATTERNS:
            for match in pattern.finditer(line):
                found.append((number, what, match.group(0)))
    return found


def _scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
            )
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def test_the_project_speaks_of_what_holds():
    files = _scanned_files()
    assert any(f.name == "BENCHMARKS.md" for f in files) and any(f.suffix == ".py" for f in files)
    hits = [
        f"{f.relative_to(ROOT)}:{n}: {what} ({words!r})"
        for f in files
        for n, what, words in offences(f.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not hits, "wording about how the work was organised:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "text",
    [
        "Measured in session 5 on the shared machine.",
        "### The squeeze (session 5)",
        "rerun by the lead on a quiet machine",
        "the lead's re-measurements",
        "load 2–15 while two helpers ran tests",
        "checked on the `vhalf` branch before its merge",
        "other sessions' jobs running",
        "(load average 25–46, 8 engineers)",
        "Runtime features (issue 16):",
        "the issue's 500,000 actions per second",
        "So the 2 % of the acceptance is reachable",
        "no GPU was lent to this task",
        "as measured in this period",
        "git worktree add",
    ],
)
def test_process_wording_is_caught(text):
    assert offences(text), text


@pytest.mark.parametrize(
    "text",
    [
        "A helper thread blocks in wait() while the rank computes.",
        "group helpers, collectives and the mappings",
        "Test helpers: unit-cost makespans",
        "lead = y.shape[:-1]",
        "so tests break real runs with no test-only branch in the trainer",
        "The validator checks the issue order per member set",
        "the profile for many runs and is not re-measured",
        "profile-before.csv, profile-after.csv and the merged profile.csv",
        "the first rank to notice claims the report",
        "a plan leads to a faster step; it leads the pipeline",
        "the K-FAC task costs from FLOPs",
    ],
)
def test_code_terms_pass(text):
    assert not offences(text), offences(text)
