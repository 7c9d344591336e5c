"""Output paths no command may write, given to every command that writes a file: a name too long for the
file system (one component over 255 bytes, or the whole path over 4,096), a folder that cannot take a
file (``/proc``, ``/sys``, under a file, missing), an existing file or link (no ``--overwrite``), a
folder, an empty name, the command's own input, and a path inside a folder it reads.

Each case runs in-process (``pipewright.cli.main``); properties as for the file fuzzer
(tests/_fuzz_cli.py): refused with a one-line error before any work, no traceback, within 10 s, and
every file under the fuzz folder unchanged, none added. :data:`MINIMUM` paths per writer, over 200 in
all across 9 writers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import pipewright.training  # noqa: F401  (its cold import, torch's, is not counted in a case's bound)
from _fuzz_cli import refused, run
from _fuzz_readers import PLAN, make_base
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule

MINIMUM = 22
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = make_base(tmp_path_factory.mktemp("paths"))
    (root / "plan.json").write_text(json.dumps(PLAN))
    (root / "s.csv").write_text(to_csv(build_schedule("1f1b", 2, 4)))
    model = root / "model"
    model.mkdir()
    (root / "tokenizer.json").rename(model / "tokenizer.json")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "00.txt").write_text("the cat sat on the mat " * 10)
    (root / "blocker").write_text("a file where a folder should be")
    for name in ("existing.out", "existing.png", "existing.json", "fresh.json", "x.schedule.csv"):
        (root / name).write_bytes(os.urandom(64))
    (root / "link.out").symlink_to(root / "existing.out")
    (root / "dangling.out").symlink_to(root / "nowhere")
    run_folder = root / "old-run"
    run_folder.mkdir()
    (run_folder / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    return root


def _common(root: Path) -> list[str]:
    """Paths no writer may write (module docstring), with the fuzz folder's existing files."""
    deep = "/".join(["d" * 200] * 21)
    long_names = [f"{'a' * 256}.out", f"{'é' * 128}.png", "x" * 1000, f"{'y' * 300}/f.out", f"{deep}/f.out"]
    system = ["/proc/pipewright-x.out", "/proc/self/pipewright-x.out", "/sys/pipewright-x.out"]
    system += ["/proc/no-such-folder/x.out", "/dev/null/x.out"]
    local = [f"{'n' * 255}/{'m' * 250}.out", "blocker/x.out", "blocker/deeper/x.out", "missing/x.out"]
    local += ["existing.out", "existing.png", "existing.json", "link.out", "dangling.out", "model"]
    return [*(f"{root}/{n}" for n in long_names), *system, *(f"{root}/{n}" for n in local), str(root)]


def _file_outputs(root: Path) -> list[str]:
    return [*_common(root), "", "."]


def _run_outputs(root: Path) -> list[str]:
    """``train --out``: a run folder, whose missing parents are made (so those paths are not wrong)."""
    made = (str(root), f"{root}/model", f"{root}/missing/x.out", f"{root}/{'n' * 255}/{'m' * 250}.out")
    own = ["old-run", "existing.out/run", "link.out/run", "blocker", f"{'q' * 256}/run"]
    return [p for p in _common(root) if p not in made] + ["", "/proc/self/run", *(f"{root}/{n}" for n in own)]


@pytest.fixture(scope="module")
def writers(root) -> dict[str, tuple[Callable[[str], list[str]], list[str]]]:
    """Each writer: its command for an output path, and the paths refused (common and its own)."""
    text, model = str(root / "text.txt"), str(root / "model")
    plan, csv = str(root / "plan.json"), str(root / "s.csv")
    simulate = ["simulate", "--schedule", csv, "--stages", "2", "--microbatches", "4"]
    plan_cmd = ["plan", "--model", "gpt-tiny", "--gpu", "cpu", "--gpus-per-node", "2"]
    plan_cmd += ["--global-batch-size", "4", "--no-baselines", "--no-progress"]
    profile = ["profile", "--model", "gpt-tiny", *TINY, "--repeats", "1", "--warmup", "0", "--no-progress"]
    train = [
        "train",
        "--dry-run",
        "--data",
        str(root / "tokens.bin"),
        *TINY,
        "--pp",
        "2",
        "--eval-every",
        "0",
    ]
    prepare = ["data", "prepare", str(root / "corpus"), text, "--tokenizer", model, "-o"]
    prepare_own = [
        text,
        f"{root}/corpus/00.txt",
        f"{root}/corpus/new.bin",
        f"{root}/fresh.bin",
        f"{model}/o.bin",
    ]
    return {
        "data prepare -o": (lambda p: [*prepare, p], [*_file_outputs(root), *prepare_own]),
        "export-plan -o": (
            lambda p: ["export-plan", plan, "--to", "megatron", "-o", p],
            [*_file_outputs(root), plan],
        ),
        "plan -o": (lambda p: [*plan_cmd, "-o", p], [*_file_outputs(root), f"{root}/x.json"]),
        "simulate --png": (lambda p: [*simulate, "--png", p], [*_file_outputs(root), csv]),
        "simulate --trace": (lambda p: [*simulate, "--trace", p], [*_file_outputs(root), csv]),
        "schedule export -o": (
            lambda p: ["schedule", "export", "1f1b", "-p", "2", "-m", "4", "-o", p],
            _file_outputs(root),
        ),
        "profile --out": (lambda p: [*profile, "--out", p], _file_outputs(root)),
        "profile --calibration": (lambda p: [*profile, "--calibration", p], _file_outputs(root)),
        "train --out": (lambda p: [*train, "--out", p], _run_outputs(root)),
    }


WRITERS = ["data prepare -o", "export-plan -o", "plan -o", "simulate --png", "simulate --trace"]
WRITERS += ["schedule export -o", "profile --out", "profile --calibration", "train --out"]


@pytest.mark.parametrize("writer", WRITERS)
def test_unwritable_and_protected_outputs_are_refused_before_any_work(
    root, writers, tmp_path, monkeypatch, writer
):
    monkeypatch.chdir(root)
    monkeypatch.setenv("PIPEWRIGHT_CACHE", str(tmp_path / "cache"))
    argv, paths = writers[writer]
    assert len(paths) >= MINIMUM
    failures = [why for p in paths if (why := refused(argv(p), root, f"{writer} {p[:80]!r}"))]
    assert not failures, f"{len(failures)} of {len(paths)}:\n" + "\n".join(failures[:8])


def test_overwrite_replaces_an_existing_output(root, tmp_path):
    out = tmp_path / "s.csv"
    out.write_text("old")
    argv = ["schedule", "export", "1f1b", "-p", "2", "-m", "4", "-o", str(out)]
    assert run(argv).code == 2 and out.read_text() == "old"
    assert run([*argv, "--overwrite"]).code == 0 and out.read_text().startswith("0F0")
