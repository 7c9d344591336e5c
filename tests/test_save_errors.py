"""A checkpoint save that fails (here: a file-size limit, RLIMIT_FSIZE, which makes writes fail with
EFBIG as a full disk does, also for root) says which file, which rank and why in one line, keeps the
previous checkpoint, and stops, retries or skips as ``--on-save-error`` says."""

from __future__ import annotations

import resource
import signal
from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch

from pipewright.runtime.checkpointing import save_errors
from pipewright.runtime.checkpointing.checkpoint import (
    latest_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from pipewright.runtime.checkpointing.save_errors import CheckpointSaveError, with_policy


@contextmanager
def _file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _state():
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return dict(model.named_parameters()), opt


def test_failed_save_names_rank_file_and_cause_and_keeps_the_previous(tmp_path) -> None:
    params, opt = _state()
    folder = tmp_path / "checkpoints"
    first = save_checkpoint(folder, 1, params, opt, meta={"fingerprint": "f"})
    with _file_size_limit(1024), pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(folder, 2, params, opt, meta={"fingerprint": "f"})
    line = str(info.value)
    assert len(line.splitlines()) == 1
    assert "step_2" in line and "rank 0: file too large" in line and "kept" in line
    assert "writing " + str(folder / "step_2.tmp" / "__0_") in line  # the file the rank was writing
    assert latest_checkpoint(folder) == first and resumable_checkpoint(folder) == (first, [])
    assert not (folder / "step_2.tmp").exists()


@pytest.mark.parametrize("policy, calls, result", [("stop", 1, None), ("retry", 3, None), ("skip", 1, None)])
def test_on_save_error_policies(monkeypatch, caplog, policy, calls, result) -> None:
    monkeypatch.setattr(save_errors, "RETRY_WAIT_S", 0.0)
    seen = []

    def save():
        seen.append(1)
        raise CheckpointSaveError("saving checkpoint x failed (rank 1: disk full writing x/y)")

    if policy == "skip":
        with caplog.at_level("WARNING"):
            assert with_policy(save, policy, "step 3") is result
        assert "skipped" in caplog.text
    else:
        with pytest.raises(CheckpointSaveError, match="rank 1: disk full"):
            with_policy(save, policy, "step 3")
    assert len(seen) == calls


def test_retry_succeeds_on_a_later_attempt(monkeypatch) -> None:
    monkeypatch.setattr(save_errors, "RETRY_WAIT_S", 0.0)
    tries = iter([CheckpointSaveError("x"), "done"])

    def save():
        value = next(tries)
        if isinstance(value, Exception):
            raise value
        return value

    assert with_policy(save, "retry", "step 1") == "done"


def test_dcp_failures_become_one_line_per_rank() -> None:
    class Failed(Exception):
        failures: ClassVar = {
            1: PermissionError(13, "Permission denied", "/r/step_4.tmp/__1_0.distcp"),
            0: OSError(28, "No space left", "/r/a"),
        }

    line = save_errors.describe(Failed("ranks:dict_keys([0, 1])"))
    assert (
        line == "rank 0: disk full writing /r/a; rank 1: permission denied writing /r/step_4.tmp/__1_0.distcp"
    )
