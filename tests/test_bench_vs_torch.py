"""The benchmark against torch.distributed.pipelining stays honest: for the tiny model both runtimes run
the same compute order and give the same losses and gradients (one step each, no timing asserted)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_same_losses_and_gradients_as_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(schedules, "ScheduleZBVZeroBubble"):
        pytest.skip("this PyTorch has no ScheduleZBVZeroBubble")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # spawned workers import the benchmark module by name
    bench = importlib.import_module("bench_vs_torch")
    [result] = bench.run(["tiny"], ["zbv-torch"], [0], warmup=0, timeout_s=120)
    assert result["same_order"] is True
    assert not result["loss_count_mismatch"]
    assert len(result["losses"]) == bench.SIZES["tiny"].microbatches
    assert result["loss_abs_diff"] < 1e-6
    assert result["grad_rel_diff"] < 1e-5
