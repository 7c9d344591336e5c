"""Start-up stage lines (``runtime/setup/startup.py``): a stage that outlasts ``SLOW_S`` is said on stderr
with its duration at the end, a fast one is not; a real ``train`` (forked workers, ``SLOW_S`` = 0 so
every stage counts as slow) says each stage once — the launching process's check of the layout and
data, rank 0's process group, model and first step — and no other rank repeats them.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.runtime.setup import startup


def test_a_slow_stage_is_said_and_timed_a_fast_one_is_not(monkeypatch) -> None:
    monkeypatch.setattr(startup, "SLOW_S", 0.05)
    out = io.StringIO()
    with startup.stage("building the model", stream=out):
        time.sleep(0.3)
    with startup.stage("joining the process group", stream=out):
        pass
    with startup.stage("another rank's model", enabled=False, stream=out):
        time.sleep(0.1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "building the model… (0.05 s so far)"
    done = re.fullmatch(r"building the model: done in (\d+\.\d) s", lines[1])
    assert done and float(done[1]) >= 0.3 and len(lines) == 2
    out = io.StringIO()
    with pytest.raises(ValueError), startup.stage("loading the checkpoint", stream=out):
        time.sleep(0.2)
        raise ValueError("unreadable")
    assert out.getvalue().splitlines() == ["loading the checkpoint… (0.05 s so far)"]  # no "done"


def test_train_says_each_start_up_stage_once(monkeypatch, capfd, tmp_path: Path) -> None:
    monkeypatch.setattr(startup, "SLOW_S", 0.0)
    args = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8"]
    args += ["--pp", "2", "--steps", "2", "--warmup", "0", "--eval-every", "0", "--out", str(tmp_path / "r")]
    with forked_cli_launches():
        assert main(["train", *args]) == 0
    said = [line.split("…")[0] for line in capfd.readouterr().err.splitlines() if "… (0 s so far)" in line]
    assert said == [
        "checking the layout and the data",
        "joining the process group",
        "building the model",
        "step 1 of 2",
    ]
