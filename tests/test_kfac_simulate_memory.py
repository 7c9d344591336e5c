"""K-FAC's memory in ``pipewright simulate --fill kfac``: each rank's peak with K-FAC is the measured
program's (``train --dry-run --measure --optimizer kfac`` for the same run, whose simulated side reports
the same peak split into parts that add up to it), its ``kfac`` part is what K-FAC adds to the plain
schedule's peak, the other parts do not move, and the fit check counts it."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from pipewright.cli import main
from pipewright.features.kfac.simulate_memory import memory_report, no_fit
from pipewright.measure import measure_run
from pipewright.measure.simulated_side import predict, sim_setup
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import prepare
from test_measure_kfac import TINY

#: ``simulate``'s flags for TINY's run as ``--measure`` prices it (h100-sxm, gradients in the compute
#: dtype, each stage's output kept until its backward)
FLAGS = [
    "simulate", "--schedule", "1f1b", "--model", "llama", "--layers", "4", "--hidden", "64", "--heads", "4",
    "--ffn-hidden", "128", "--seq-len", "32", "--vocab", "256", "--gpu", "h100-sxm", "--gpus-per-node", "2",
    "--pp", "2", "--microbatch-size", "1", "--microbatches", "4", "--dtype", "bf16", "--grad-dtype", "bf16",
    "--stage-outputs", "kept", "--json",
]  # fmt: skip


def _simulate(*extra: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([*FLAGS, *extra])
    return status, json.loads(out.getvalue())


#: the parts that are not the peak's: ``total`` holds them all, and buffers in flight are not counted
NOT_PEAK = {"total", "allocator_reserve", "communication_buffers"}


@pytest.fixture(scope="module")
def run():
    config = TrainConfig(**TINY)
    return prepare(config, world_size=config.world_size, check_size=False)


def test_simulate_prices_kfac_memory_as_the_program_measures_and_moves_nothing_else():
    status, filled = _simulate("--fill", "kfac")
    plain_status, plain = _simulate()
    assert status == plain_status == 0 and filled["memory"]["fits"]
    measured = [c.measured.peak_bytes for c in measure_run(TrainConfig(**TINY))]
    assert [r["peak_memory_bytes"] for r in filled["per_rank"]] == pytest.approx(measured, rel=0.005)
    for with_kfac, without in zip(filled["per_rank"], plain["per_rank"], strict=True):
        parts, base = with_kfac["memory_parts"], without["memory_parts"]
        assert "kfac" not in base  # K-FAC off: no part, and the plain report is the one simulate gives
        added = with_kfac["peak_memory_bytes"] - without["peak_memory_bytes"]
        assert parts["kfac"] == added >= with_kfac["kfac"]["factors_inverses_bytes"] > 0
        for key in set(base) - {"allocator_reserve", "total"}:
            assert parts[key] == base[key], key
        assert parts["allocator_reserve"] == pytest.approx(base["allocator_reserve"] + 0.05 * added)
        assert parts["total"] - parts["communication_buffers"] - parts["allocator_reserve"] == pytest.approx(
            with_kfac["peak_memory_bytes"]
        )
    assert filled["memory"]["peak_bytes"] == max(r["peak_memory_bytes"] for r in filled["per_rank"])


@pytest.mark.parametrize(
    ("changes", "at_step"),
    [({}, True), ({"model": "gpt", "precision": "fp32", "microbatches": 8}, False)],
)  # the peak at the optimizer step (bf16 gradients' fp32 copies), and in the iteration
def test_measure_splits_the_simulated_peak_into_parts_that_add_up(changes, at_step):
    config = TrainConfig(**{**TINY, **changes})
    run = prepare(config, world_size=config.world_size, check_size=False)
    simulated = memory_report(sim_setup(run))["per_rank"]
    for row, p in zip(simulated, predict(run), strict=True):
        assert p.peak_bytes == row["peak_memory_bytes"]
        assert p.parts["kfac_state"] == row["kfac"]["factors_inverses_bytes"] > 0
        assert ("step_gradients" in p.parts) is at_step
        assert sum(v for k, v in p.parts.items() if k not in NOT_PEAK) == p.peak_bytes
        total = p.parts["total"]
        assert sum(v for k, v in p.parts.items() if k != "total") == pytest.approx(total, rel=1e-12)


def test_the_fit_check_counts_kfac_memory(run):
    setup = sim_setup(run)
    plain = max(float(p) for p in setup.simulate().peak_memory)
    report = memory_report(replace(setup, memory_limit=plain))  # the plain schedule fits exactly
    peaks = [r["peak_memory_bytes"] for r in report["per_rank"]]
    assert not report["memory"]["fits"] and report["memory"]["over_limit"] == [0, 1]
    assert min(peaks) > plain
    assert no_fit(report).startswith("ranks [0, 1] do not fit") and "\n" not in no_fit(report)


def test_the_text_report_has_a_kfac_column(capsys):
    assert main([*FLAGS[:-1], "--fill", "kfac"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("memory (GiB)"))
    assert head.split()[-2:] == ["K-FAC", "total"]
