"""The framework inputs (plan/spec_inputs.py) price the same on ``plan`` as on ``simulate``, and
``simulate --microbatch-group`` prices interleaved 1F1B's warm-up with the group N."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _cli_json import cli_json
from pipewright.cli import main
from pipewright.schedules.classic import interleaved_memory

MODEL = shlex.split(
    "--model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16 "
    "--mlp swiglu --gpu h100-sxm --nodes 1 --gpus-per-node 8 --global-batch-size 16 --tp 1 --pp 2 --dp 4 "
    "--recompute none"
)
FLAGS = ["--kernels", "eager", "--grad-dtype", "bf16", "--fsdp-grad-sync", "step", "--stage-outputs", "kept"]


def _plan(flags: list[str]) -> tuple[float, float]:
    argv = ["plan", *MODEL, "--schedules", "1f1b", "--microbatch-sizes", "1", "--optimizer-sharding", "fsdp"]
    got = cli_json([*argv, "--cp", "1", "--no-baselines", "--no-progress", *flags])["predicted"]
    return got["iteration_time_s"], got["peak_memory_bytes"]


def _simulate(flags: list[str]) -> tuple[float, float]:
    got = cli_json(["simulate", *MODEL, "--schedule", "1f1b", "--microbatch-size", "1", "--fsdp", *flags])
    return got["iteration_time_s"], got["memory"]["peak_bytes"]


def test_plan_prices_the_framework_inputs_as_simulate_does():
    planned, simulated = _plan(FLAGS), _simulate(FLAGS)
    assert planned == pytest.approx(simulated, rel=1e-12)
    default = _plan([])
    assert planned[0] > default[0] and planned[1] > default[1]  # eager kernels; gradients held unsharded


@pytest.mark.parametrize("group", [None, 4, 8])
def test_microbatch_group_sets_the_interleaved_warm_up(group):
    argv = ["simulate", "--schedule", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "2", "--cost", "unit"]
    got = cli_json(argv + ([] if group is None else ["--microbatch-group", str(group)]))
    peaks = [r["peak_memory_bytes"] for r in got["per_rank"]]
    assert peaks == [float(x) for x in interleaved_memory(4, 8, 2, group)]


@pytest.mark.parametrize(
    ("schedule", "group", "message"),
    [("interleaved-1f1b", "2", "must be at least p = 4"), ("1f1b", "4", "1f1b does not")],
)
def test_microbatch_group_errors_in_one_line(capsys, schedule, group, message):
    argv = ["simulate", "--schedule", schedule, "-p", "4", "-m", "8", "--cost", "unit"]
    assert main([*argv, "--microbatch-group", group]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 5), v=st.integers(2, 3), extra=st.integers(0, 4), groups=st.integers(1, 2))
def test_every_group_megatron_accepts_runs_without_deadlock(p, v, extra, groups):
    """For p ≤ N and m a multiple of N, the order validates (no deadlock under blocking sends) and each
    rank's peak is its warm-up plus one chunk-microbatch."""
    from pipewright.plan.setup import unit_setup
    from pipewright.schedules.classic import interleaved_1f1b
    from pipewright.sim import simulate

    n = p + extra
    sched = interleaved_1f1b(p, n * groups, v, group=n)
    got = simulate(sched, unit_setup(sched).cost, validate=True).peak_memory
    assert list(got) == pytest.approx([float(x) for x in interleaved_memory(p, n * groups, v, n)])


def test_the_flags_choices_are_the_cost_models():
    """`simulate`/`plan` declare the framework inputs' choices without importing the cost models (start-up
    time); they must be the values the cost models and the plan files accept."""
    import argparse

    from pipewright.plan.planfile import FRAMEWORK_INPUTS
    from pipewright.runspec import add_spec_flags

    parser = argparse.ArgumentParser()
    add_spec_flags(parser, "simulate")
    choices = {a.dest.split(".")[-1]: tuple(a.choices) for a in parser._actions if a.choices is not None}
    for name, (values, _) in FRAMEWORK_INPUTS.items():
        if values is not None:
            assert choices[name] == values, name
