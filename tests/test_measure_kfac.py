"""``--optimizer kfac`` measured against the simulator: K-FAC's memory as
:mod:`pipewright.features.kfac.curvature_memory` prices it (factors and inverses, the recording
iteration's kept inputs and output gradients, the preconditioned gradients, the step's KL-clip), and
the bubble plan the measured program follows (the same tasks in the same bubbles on every run)."""

from __future__ import annotations

import pytest

from pipewright.features.kfac.curvature_memory import CoveredLinear, RankLinears, memory_deltas, plan_fills
from pipewright.features.kfac.kinds import KFAC_FILL
from pipewright.ir import Action, B, F
from pipewright.measure import measure_run
from pipewright.runtime.setup.config import TrainConfig
from test_measure import TINY as MEASURED

TINY = {**MEASURED, "microbatches": 4, "schedule": "1f1b", "optimizer": "kfac"}


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_kfac_ranks_match_the_simulator_and_repeat_exactly(model):
    config = TrainConfig(**{**TINY, "model": model})
    first = measure_run(config)
    for cmp in first:
        m, p = cmp.measured, cmp.predicted
        assert p.parts["kfac_state"] > 0
        assert m.peak_bytes == pytest.approx(p.peak_bytes, rel=0.005), (model, m.pp_rank)
        assert p.plan.fills and any(p.plan.fills.values())  # tasks were placed in bubbles
        for kind in (KFAC_FILL, "KFAC_PRECOND"):  # the planned curvature and the preconditioning
            assert m.flops[kind] == p.flops[kind] > 0, (model, kind)
    again = measure_run(config)  # the planned fills: the same peak, byte for byte, at the same action
    assert [(c.measured.peak_bytes, c.measured.peak_action) for c in again] == [
        (c.measured.peak_bytes, c.measured.peak_action) for c in first
    ]


LAYER = CoveredLinear(8, 4, False, "x")
KEPT_NOT = CoveredLinear(8, 4, False, "y", kept=False)


def _row(fill_after: int) -> list[Action]:
    """F0 F1 B0 B1 with one bubble after the ``fill_after``-th action."""
    row = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    return [*row[:fill_after], Action(0, KFAC_FILL, None, 0), *row[fill_after:]]


def test_a_bubble_runs_the_pending_tasks_that_fit_in_priority_order():
    linears = RankLinears.of({0: 1}, (LAYER,))
    estimates = {("A", 0): 1.0, ("B", 0): 0.5}
    budgets = {(0, 0): 2.2}  # both A (1.05 each of what is left), then no B (0.525 > 0.2)
    plan = plan_fills(_row(4), linears, budgets, estimates)
    assert plan[(0, 0)] == (("A", 0, 0), ("A", 0, 1))
    assert plan_fills(_row(4), linears, {(0, 0): 1.0}, estimates)[(0, 0)] == (("B", 0, 0),)
    assert plan_fills(_row(4), linears, {(0, 0): 0.5}, estimates)[(0, 0)] == ()


def test_kept_inputs_cost_nothing_until_their_backward_and_everything_run_is_freed():
    tokens, e = 10, 2
    linears = RankLinears.of({0: 1}, (LAYER, KEPT_NOT))
    tasks = tuple((w, i, k) for w in "AB" for i in (0, 1) for k in (0, 1))
    deltas = memory_deltas(_row(4), linears, {(0, 0): tasks}, tokens, e)
    # F: only the input autograd does not keep; B: the kept input stays (K-FAC reads it) + 2 gradients
    assert deltas[:2] == [tokens * 8 * e] * 2
    assert deltas[2:4] == [tokens * (8 + 4 + 4) * e] * 2
    sums = 4.0 * (8**2 + 4**2) * 2  # A's and B's running sums of both layers
    assert deltas[4] == sums - 2 * tokens * (8 + 8 + 4 + 4) * e
    assert sum(deltas) == sums
