"""Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it) during a real
``pipewright train`` run (2 worker processes, tiny model): the run ends as under SIGTERM — the step is
finished and checkpointed, one line with the ``--resume`` hint, exit status 130 — and no process prints
a ``KeyboardInterrupt`` traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipewright.data.tokens import write_tokens
from pipewright.runtime.reliability.interrupts import INTERRUPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--microbatch-size", "2"]
TINY += ["--microbatches", "2", "--eval-every", "0", "--no-progress", "--no-artifacts", "--steps", "6"]
TINY += ["--checkpoint-every", "2"]


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_and_exits_130_without_a_traceback(tmp_path):
    data, out = tmp_path / "tokens.bin", tmp_path / "run"
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 100, dtype=np.uint8)
    write_tokens(data, text.astype(np.int64), vocab_size=256)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PIPEWRIGHT_FAULTS": "pause:step=3:ms=60000"}
    cmd = [sys.executable, "-m", "pipewright", "train", *TINY, "--data", str(data), "--out", str(out)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # the launcher and its workers, as Ctrl-C in a terminal
        output, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == INTERRUPTED_EXIT_CODE, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert f"interrupted (Ctrl-C) after step 4: checkpoint in {out}; continue with --resume" in output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
