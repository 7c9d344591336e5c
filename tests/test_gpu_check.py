"""tools/gpu_check.sh, the first checks on a GPU machine, exercised without one: the checks it plans
for 1, 2 and 8 GPUs (every schedule at pp 2, tp 2 from four GPUs, single-GPU MFU, sim vs measured), a
planned train command accepted as written by ``pipewright train --dry-run``, and the table it prints
from a finished check's results."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipewright.hardware import accelerator
from pipewright.schedules.registry import schedule_names

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def _dry_run(gpus: int) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", "--gpus", str(gpus), "--out", "o"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )  # fmt: skip
    return out.stdout.splitlines()[1:]


def test_dry_run_plans_every_schedule_and_the_single_gpu_checks() -> None:
    eight, one = _dry_run(8), _dry_run(1)
    names = [line.split(" ", 1)[0] for line in eight]
    assert names == [
        "calibration",
        "profile",
        *(f"train:{s}" for s in schedule_names()),
        "check",
        "mfu",
        "compare",
    ]
    trains = [line for line in eight if line.startswith("train:")]
    assert all("--pp 2 --tp 2" in line and "--precision bf16" in line for line in trains)
    assert "--device cuda" in eight[0] and "--calibration o/calibration.json" in eight[0]
    assert [line.split(" ", 1)[0] for line in one] == ["calibration", "profile", "mfu"]
    assert all("--tp 1" in line for line in gpu_check_lines(2) if line.startswith("train:"))


def gpu_check_lines(gpus: int) -> list[str]:
    return [f"{n} {shlex.join(argv)}" for n, _, argv in gpu_check.plan(gpus, "o")]


@pytest.mark.slow
def test_a_planned_train_command_is_accepted_as_written(tmp_path) -> None:
    """The CPU plan's DualPipeV run (two chunks per rank) through `train --dry-run`: flags, data,
    schedule and layout checked, no worker started."""
    (argv,) = [a for n, _, a in gpu_check.plan(2, str(tmp_path), "cpu") if n == "train:dualpipev"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no worker started" in done.stdout


def test_table_reads_each_checks_number(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "results.tsv").write_text(
        "calibration\t0\t30\ntrain:1f1b\t0\t12\ntrain:zbv\t1\t9\nmfu\t0\t15\ncompare\t0\t40\ncheck\tskip\t0\n"
    )
    (tmp_path / "logs" / "train-zbv.log").write_text("starting\nRuntimeError: NCCL error: unhandled\n")
    (tmp_path / "calibration.json").write_text(
        json.dumps({"device_name": "NVIDIA H100", "accelerator": "h100-sxm"})
    )
    for folder, rate in (("train-1f1b", 1000.0), ("mfu", 50_000.0)):
        (tmp_path / folder).mkdir()
        rows = [{"step": i, "step_time_s": 0.1 + 0.01 * i, "tokens_per_s": rate * (i + 1)} for i in range(4)]
        (tmp_path / folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = {"layers": 8, "hidden": 1024, "seq_len": 1024, "vocab": 32000}
    (tmp_path / "mfu" / "config.json").write_text(json.dumps(config))
    (tmp_path / "compare").mkdir()
    report = {"measured": {"step_time_s": 0.2}, "predicted": {"step_time_s": 0.25}, "ratio": 0.8}
    (tmp_path / "compare" / "compare.json").write_text(json.dumps(report))
    rows = {line.split()[0]: line for line in gpu_check.table(tmp_path).splitlines()[2:]}
    assert "NVIDIA H100 (h100-sxm)" in rows["calibration"]
    assert "120.0 ms/step" in rows["train:1f1b"]  # the median after the first step: 0.11, 0.12, 0.13
    assert "failed 1" in rows["train:zbv"] and "NCCL error: unhandled" in rows["train:zbv"]
    flops = 72 * 8 * 1024**2 * (1 + 1024 / (6 * 1024) + 32000 / (12 * 8 * 1024))
    mfu = flops * 150_000 / accelerator("h100-sxm").peak("bf16")
    assert f"MFU {100 * mfu:.1f}%" in rows["mfu"]
    assert "sim 250.0 ms vs measured 200.0 ms (×0.80)" in rows["compare"]
    assert "skipped" in rows["check"]
