"""Fidelity: the cost model predicts every row of Megatron-LM Table 1 within 10 % with one set of A100
efficiency parameters (pipewright.cost.transformer.A100_EFFICIENCY)."""

from pathlib import Path

import pytest

from pipewright.cost.base import FreeComm
from pipewright.cost.comm import Mesh
from pipewright.cost.megatron import (
    TABLE1,
    closed_form_iteration_time,
    load_table1,
    predict_table1_row,
    simulated_iteration_time,
    table1_cost,
    table1_schedule,
)
from pipewright.cost.transformer import A100_EFFICIENCY, TransformerCost
from pipewright.ir import Action, B, F
from pipewright.models.presets import get_preset
from pipewright.models.spec import ModelSpec

REFERENCE = Path("/work/shared/reference/megatron_table1.csv")


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: r.name)
def test_row_within_ten_percent(row):
    """The simulator's prediction (and Megatron's closed form on the same costs) within 10 %."""
    for timer in (simulated_iteration_time, closed_form_iteration_time):
        predicted = predict_table1_row(row, A100_EFFICIENCY, timer)
        assert abs(predicted / row.tflops_per_gpu - 1) < 0.10, (row.name, timer.__name__, predicted)


def test_rows_are_the_presets():
    for row in TABLE1:
        spec, preset = row.spec(), get_preset(row.name)
        assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (
            preset.layers, preset.hidden, preset.heads, preset.vocab, preset.seq_len,
        )  # fmt: skip
        assert row.tp * row.pp * row.dp == row.gpus
        assert row.microbatches * row.microbatch * row.dp == row.global_batch


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference data not on this machine")
def test_table_matches_reference_csv():
    assert load_table1(REFERENCE) == TABLE1


def test_closed_form_is_megatrons_bubble_formula_for_equal_stages():
    # no embedding/logit imbalance: vocabulary 1, stages of equal size
    spec = ModelSpec("eq", layers=8, hidden=512, heads=8, vocab=1, seq_len=256)
    row = TABLE1[4]  # p = 2, v = 1
    cost = TransformerCost(spec, microbatch=1, mesh=Mesh(pp=2))
    schedule = table1_schedule(row)
    tf = cost.compute_time(Action(0, F, 0), schedule)
    tb = cost.compute_time(Action(0, B, 0), schedule)
    m = schedule.num_microbatches
    expected = (m + 1) * (tf + tb)
    assert closed_form_iteration_time(schedule, cost, FreeComm()) == pytest.approx(expected, rel=1e-3)
    assert table1_cost(row).mesh == Mesh(tp=8, pp=2, dp=32)
