"""Fidelity: Megatron-LM Table 1 predicted within 5 % (the figure the README states) with one set of
A100 efficiency parameters (pipewright.cost.transformer.A100_EFFICIENCY), and ``pipewright simulate``
giving the library's predictions (both build the setup with pipewright.plan.setup.model_setup)."""

import contextlib
import io
import json

import pytest

from pipewright.cli import main
from pipewright.cost.base import FreeComm
from pipewright.cost.megatron import TABLE1, closed_form_iteration_time, packaged_table1
from pipewright.cost.transformer import TransformerCost, megatron_flops_per_iteration
from pipewright.ir import REDUCE_GRAD, Action, B, F
from pipewright.mesh import Mesh
from pipewright.models.presets import get_preset
from pipewright.models.spec import ModelSpec
from pipewright.plan.table1 import (
    predict_table1_row,
    simulated_iteration_time,
    table1_arguments,
    table1_cost,
    table1_setup,
)
from pipewright.schedules.registry import build_schedule

TOLERANCE = 0.05


def _published():
    """The published table as the package ships it (runs in a plain checkout)."""
    return packaged_table1()


def _cli_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_table_matches_reference_csv():
    assert _published() == TABLE1


@pytest.mark.parametrize("index", range(len(TABLE1)), ids=[r.name for r in TABLE1])
def test_simulate_cli_and_library_agree_within_five_percent(index):
    """`pipewright simulate` and the library predict the same iteration time; the TFLOP/s per GPU of
    both (Megatron's FLOP count) and of the closed form are within 5 % of the published row."""
    row = _published()[index]
    report = _cli_json(table1_arguments(row))
    flops = megatron_flops_per_iteration(row.spec(), row.global_batch, "full")
    cli_tflops = flops / (report["iteration_time_s"] * row.gpus) / 1e12
    assert cli_tflops == pytest.approx(predict_table1_row(row), rel=1e-12)  # the same iteration time
    assert report["tflops_per_device"] == pytest.approx(cli_tflops, rel=1e-6)  # the cost's FLOPs = Megatron's
    assert abs(cli_tflops / row.tflops_per_gpu - 1) < TOLERANCE, (row.name, cli_tflops)
    closed = predict_table1_row(row, iteration_time=closed_form_iteration_time)
    assert abs(closed / row.tflops_per_gpu - 1) < TOLERANCE, (row.name, "closed form", closed)


def test_setup_reduces_gradients_after_the_pipeline():
    """The rows run with dp > 1: every rank ends with one REDUCE_GRAD per stage it holds, after its last
    backward (Megatron-LM's non-overlapped all-reduce), over the data-parallel group."""
    row = TABLE1[5]  # p = 4, v = 3
    schedule = table1_setup(row).schedule
    for r in range(schedule.num_ranks):
        tail = schedule.actions[r][-len(schedule.stages_of(r)) :]
        assert [a.kind for a in tail] == [REDUCE_GRAD] * len(schedule.stages_of(r))
        assert sorted(a.stage for a in tail) == sorted(schedule.stages_of(r))


def test_rows_are_the_presets():
    for row in TABLE1:
        spec, preset = row.spec(), get_preset(row.name)
        assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (
            preset.layers, preset.hidden, preset.heads, preset.vocab, preset.seq_len,
        )  # fmt: skip
        assert row.tp * row.pp * row.dp == row.gpus
        assert row.microbatches * row.microbatch * row.dp == row.global_batch


def test_closed_form_is_megatrons_bubble_formula_for_equal_stages():
    # no embedding/logit imbalance: vocabulary 1, stages of equal size
    spec = ModelSpec("eq", layers=8, hidden=512, heads=8, vocab=1, seq_len=256)
    row = TABLE1[4]  # p = 2, v = 1
    cost = TransformerCost(spec, microbatch=1, mesh=Mesh(pp=2))
    schedule = build_schedule("1f1b", row.pp, row.microbatches)
    tf = cost.compute_time(Action(0, F, 0), schedule)
    tb = cost.compute_time(Action(0, B, 0), schedule)
    m = schedule.num_microbatches
    expected = (m + 1) * (tf + tb)
    assert closed_form_iteration_time(schedule, cost, FreeComm()) == pytest.approx(expected, rel=1e-3)
    assert simulated_iteration_time(schedule, cost, FreeComm()) == pytest.approx(expected, rel=1e-3)
    assert table1_cost(row).mesh == Mesh(tp=8, pp=2, dp=32)
