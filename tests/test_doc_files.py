"""The pages that say where things are name only files that exist: docs/README.md (start here) and
docs/architecture.md. A link's target (``[training](training.md)``) must exist beside the page; a
file named in backquotes (``cost/placement.py``, ``runtime/setup/``, ``tests/test_structure.py``,
``export*.py``) must be a file or folder of the repository whose path ends with it (a pattern: one
that matches)."""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/README.md", "docs/architecture.md")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_QUOTED = re.compile(r"`([^`\s]+)`")
_FILE = re.compile(r"^[\w*.<>/-]*(\.(py|md|toml|json|csv|txt)|/)$")


@functools.cache
def repository_paths() -> tuple[str, ...]:
    """Every file and folder under the repository's own folders, as a posix path from its root."""
    out = []
    for top in ("src", "tests", "docs", "tools", "benchmarks"):
        for path in (ROOT / top).rglob("*"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            out.append(rel + "/" if path.is_dir() else rel)
    out += [p.name + "/" if p.is_dir() else p.name for p in ROOT.iterdir() if not p.name.startswith(".")]
    return tuple(out)


def exists(name: str) -> bool:
    """Whether a repository path ends with ``name`` (a ``*`` pattern: matches one)."""
    if "<" in name:  # a placeholder (features/<name>/kinds.py): its fixed parts
        return any(fnmatch.fnmatch(p, "*" + re.sub(r"<[^>]*>", "*", name)) for p in repository_paths())
    if "*" in name:
        return any(fnmatch.fnmatch(p, "*" + name) for p in repository_paths())
    return any(p == name or p.endswith("/" + name) for p in repository_paths())


def named_files(text: str) -> list[str]:
    return [w for w in _QUOTED.findall(text) if _FILE.match(w) and not w.startswith(("-", "http"))]


def test_the_checker_tells_a_missing_file() -> None:
    assert exists("cost/placement.py") and exists("runtime/setup/") and exists("export*.py")
    assert not exists("DESIGN.md") and not exists("cost/no_such_module.py")
    assert named_files("see `cost/llama.py`, `--tp`, `E|t*1|L` and `tests/test_structure.py`") == [
        "cost/llama.py",
        "tests/test_structure.py",
    ]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_names_only_files_that_exist(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    folder = (ROOT / page).parent
    links = [t.split("#")[0] for t in _LINK.findall(text) if not t.startswith(("http", "#", "mailto:"))]
    broken = [t for t in links if t and not (folder / t).exists()]
    assert not broken, f"{page} links to files that do not exist: {broken}"
    missing = [n for n in named_files(text) if not exists(n)]
    assert not missing, f"{page} names files that do not exist: {missing}"
