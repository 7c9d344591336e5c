"""Malformed files given to the commands that read them: a corpus per reader (cut short, not UTF-8,
garbage, the wrong kind of document, each field NaN / infinite / negative / zero / huge / of the wrong
type, a required field removed, and the reader's own kinds of damage), each file run through the
command that reads it, in-process (``pipewright.cli.main``).

Properties (tests/_fuzz_cli.py): every case refused — a non-zero status with a one-line error as the
last line, no traceback, within 10 s — and the case's files unchanged, nothing written beside them.
Each reader's valid file is run first and must pass, so a refusal is the damage's doing. The counts
per reader at least :data:`MINIMUM`: over 1,000 files across 12 readers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers  # noqa: F401  (its cold import too)

import pipewright.training  # noqa: F401  (its cold import, torch's, is not counted in a case's bound)
from _fuzz_cli import refused, run
from _fuzz_readers import MINIMUM, READERS, make_base


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("base"))


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    first = next(iter(files))
    return folder / (first.split("/")[0] if "/" in first else first)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """The working folder and the token cache in ``tmp_path`` (nothing is written elsewhere)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEWRIGHT_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("name", list(READERS))
def test_malformed_files_are_refused_in_one_line(base, isolated, name):
    reader = READERS[name](base)
    assert len(reader.cases) >= MINIMUM, len(reader.cases)
    ok = isolated / "valid"
    ok.mkdir()
    target = _write(ok, reader.valid)
    outcome = run(reader.argv(str(ok if reader.folder else target)))
    assert outcome.code == 0, f"the valid {name} file is refused: {outcome.err[-600:]}"
    failures = []
    for i, (what, files) in enumerate(reader.cases):
        folder = isolated / f"case{i}"
        folder.mkdir()
        target = _write(folder, files)
        why = refused(reader.argv(str(folder if reader.folder else target)), folder, f"{name}: {what}")
        if why:
            failures.append(why)
    assert not failures, f"{len(failures)} of {len(reader.cases)}:\n" + "\n".join(failures[:8])
    assert not (isolated / "runs").exists()
