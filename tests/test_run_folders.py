"""Protected run folders (runtime/checkpointing/run_folder.py): a rerun, a concurrent run and two default runs
in one
second leave every file of the first run unchanged (compared by checksum); the refusals are one line."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.runtime.checkpointing import run_folder
from pipewright.runtime.checkpointing.run_folder import LOCK_NAME, RunLock, claim

TINY = ["--model", "gpt-tiny", "--steps", "2", "--no-progress", "--no-artifacts"]


def _first_run(folder: Path) -> dict[str, str]:
    """A finished run's files (what train leaves), and their checksums."""
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000002" / "meta.json").write_text('{"step": 2}')
    (folder / "checkpoints" / "latest").write_text("step_00000002")
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": k, "loss": 5.0}) + "\n" for k in range(20))
    )
    (folder / "config.json").write_text('{"seed": 1}')
    return _checksums(folder)


def _checksums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("pipewright: error:")
    return err[-1]


def test_rerun_into_a_run_folder_is_refused_and_changes_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    before = _first_run(out)
    assert main(["train", "--out", str(out), *TINY]) == 2
    line = _one_line_error(capsys)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert _checksums(out) == before


def test_overwrite_moves_the_old_run_aside(tmp_path) -> None:
    out = tmp_path / "run"
    before = _first_run(out)
    folder, lock = claim(out, tmp_path, resume=False, overwrite=True)
    try:
        moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
        assert len(moved) == 1 and _checksums(moved[0]) == before  # nothing deleted, nothing changed
        assert folder == out and run_folder.holds_run(out) == []
    finally:
        lock.release()


def test_concurrent_run_is_refused_naming_the_holder(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    before = _first_run(out)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "now", "job": None}
        (out / LOCK_NAME).write_text(json.dumps(lock))
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert main(["train", "--out", str(out), *TINY, *extra]) == 2
            line = _one_line_error(capsys)
            assert f"in use by process {holder.pid}" in line
        assert _checksums(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with caplog.at_level("WARNING"):
        lock = RunLock(tmp_path).acquire()
    try:
        assert f"process {dead.pid}" in caplog.text and "stale lock" in caplog.text
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_default_folders_are_unique_within_one_second(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(run_folder, "_stamp", lambda: "20260101-000000")
    first, lock1 = claim(None, tmp_path / "runs", resume=False, overwrite=False)
    before = _first_run(first)
    second, lock2 = claim(None, tmp_path / "runs", resume=False, overwrite=False)
    try:
        assert first != second and second.name == "20260101-000000-1"
        assert _checksums(first) == before
    finally:
        lock1.release()
        lock2.release()


def test_resume_without_a_usable_checkpoint_never_advises_overwriting(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    _first_run(out)
    (out / "checkpoints" / "step_00000002" / "meta.json").unlink()
    assert main(["train", "--out", str(out), "--resume", *TINY]) == 2
    line = _one_line_error(capsys)
    assert "without --resume" not in line and "--overwrite" in line


def test_resume_and_overwrite_together_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="give one"):
        run_folder.check_out(tmp_path, resume=True, overwrite=True)


def test_checkpoint_without_meta_is_reported_not_skipped_silently(tmp_path) -> None:
    from pipewright.runtime.checkpointing.checkpoint import resumable_checkpoint

    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / "__0_0.distcp").write_bytes(b"x")
    found, warnings = resumable_checkpoint(tmp_path)
    assert found is None and len(warnings) == 1
    assert "step_10" in warnings[0] and "meta.json" in warnings[0] and "skipped" in warnings[0]


def test_resume_of_another_model_names_the_dimension() -> None:
    from dataclasses import asdict

    from pipewright.runtime.checkpointing.resume_check import model_difference
    from pipewright.runtime.setup.config import TrainConfig

    meta = {"config": asdict(TrainConfig(model="gpt-tiny", layers=6))}
    spec = TrainConfig(model="gpt-tiny", layers=4).model_spec(256)
    assert model_difference(meta, spec, tp=1) == "--layers 6 (this run: 4)"
    assert model_difference({}, spec, tp=1) == ""


def test_torchrun_attempts_of_one_job_share_a_job_id_without_rdzv_id() -> None:
    """Without ``--rdzv-id``/``--standalone`` torchrun sets ``TORCHELASTIC_RUN_ID=none``; every attempt
    of the job still sees the agent's store address, which no other live job can bind."""
    job = run_folder._job_id
    attempt = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    restarted = {**attempt, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert job(attempt) == job(restarted) == "store 10.0.0.1:29500"
    assert job({**attempt, "MASTER_PORT": "29501"}) != job(attempt)  # another job
    loopback = {**attempt, "MASTER_ADDR": "127.0.0.1"}  # static rendezvous on one host: the host tells
    assert job(loopback, host="a") != job(loopback, host="b")
    assert job({**attempt, "TORCHELASTIC_RUN_ID": "myrun"}) == "myrun"
    assert job({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) is None  # not under torchrun


def test_torchrun_restart_before_the_first_checkpoint_is_not_refused(tmp_path, monkeypatch) -> None:
    """Attempt 1 (a dead process of the same job, ``--rdzv-id`` not given) left a lock and metrics but
    no checkpoint: attempt 2 continues in the folder; a run of another job is refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = {"pid": dead.pid, "host": socket.gethostname(), "started": "now", "job": "store 10.0.0.1:29500"}
    (out / LOCK_NAME).write_text(json.dumps(lock))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    run_folder.check_out(out, resume=False, overwrite=False)
    monkeypatch.setenv("MASTER_PORT", "29501")
    with pytest.raises(ConfigError, match="already holds a run"):
        run_folder.check_out(out, resume=False, overwrite=False)
