"""``pipewright check``: a pipelined layout against one process.

1F1B, pp = 2, a tiny GPT, with a feature of the test's own (``--feature``) that mis-scales the
microbatch loss from step 1 on — a doubled 1/m, the kind of bug that shows in the gradient norm and not
in the loss: step 0 is equal to one process (loss, gradient norm, parameters: the comparison itself is
right), step 1 is not, and the command exits 1 naming step 1 and the gradient norm. The feature takes
part only in pipelined runs (pp > 1), so the one-process reference stays right. (Two launches, of forked
workers: the pipelined run and the reference.)
"""

from __future__ import annotations

import math

import pytest

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.cli.check import TOLERANCE, param_difference
from pipewright.features import Feature
from pipewright.models.gpt import loss_fn
from pipewright.runtime.core.handlers import loss_hook
from pipewright.runtime.core.plugin import ExecutorParts, TrainingPlugin

MODEL = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8"]
LAYOUT = ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2", "--microbatch-size", "1"]


class MisscaledLoss(TrainingPlugin):
    """From the second executor run on, the loss stage's output is ℓ·2/m instead of ℓ/m."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.runs = 0

    @classmethod
    def active(cls, config, schedule) -> bool:
        return schedule.num_ranks > 1

    def executor_parts(self, ctx) -> ExecutorParts:
        stage = ctx.build.schedule.num_stages - 1
        if stage not in ctx.build.stages:
            return ExecutorParts()
        right = loss_hook(loss_fn)

        def hook(state, action, out):
            loss = right(state, action, out)
            return loss * 2 if self.runs >= 1 else loss

        return ExecutorParts(output_hooks={stage: hook})

    def after_run(self) -> None:
        self.runs += 1


MISSCALE = Feature(name="misscale", plugin=f"{__name__}:MisscaledLoss", description="a loss-scaling bug")


@pytest.mark.slow
def test_check_names_the_step_of_a_misscaled_loss(capsys):
    with forked_cli_launches():
        assert main(["check", *MODEL, *LAYOUT, "--steps", "2", "--feature", f"{__name__}:MISSCALE"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"1f1b pp=2 dp=1 tp=1 vs one process, fp32, tolerance {TOLERANCE['fp32']:g}"
    assert out[-1].startswith("differs from one process at step 1: gradient norm ")
    assert "relative difference 1.0e+00" in out[-1]  # twice the gradient
    rows = [line.split() for line in out[2:-1]]
    assert [(r[0], r[-1]) for r in rows] == [("0", "ok"), ("1", "DIFFERS")]
    assert float(rows[0][3]) == 0 and float(rows[0][6]) < 1e-6 and float(rows[0][7]) < 1e-6  # step 0 equal
    assert float(rows[1][3]) < 1e-6  # the loss itself does not show the bug


def test_parameter_difference_is_relative_to_the_model():
    want = {"a": (3.0, 1.0, 2.0), "b": (4.0, -1.0, 2.0)}
    assert param_difference(want, want) == 0.0
    got = {"a": (3.0, 1.0, 2.0), "b": (4.5, -1.0, 2.0)}
    assert math.isclose(param_difference(got, want), 0.5 / 5.0)
    assert math.isclose(param_difference({"a": want["a"]}, want), math.sqrt(16 + 0.25) / 5.0)


def test_bad_input_is_one_line(capsys):
    assert main(["check", *MODEL, *LAYOUT, "--tolerance", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pipewright: error: --tolerance must be positive (got 0.0)"
    ]
    assert main(["check", *MODEL, *LAYOUT, "--out", "somewhere"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pipewright: error: --out does not apply to check (it keeps no run folder); drop it"
    ]
