"""``--framework NAME`` (pipewright.cost.frameworks): its defaults fill only the inputs the user left
unset, its calibration adds exactly what it states (GEMM efficiency × c, τ_f per layer and pass), plan
prices it as simulate does, and each entry's fit rows are the rule's (at most half of its rows)."""

from __future__ import annotations

import contextlib
import shlex
from dataclasses import replace

import pytest

from _cli_json import cli_json
from pipewright.cli import _parser, main
from pipewright.cost import frameworks
from pipewright.cost.efficiency import default_efficiency
from pipewright.cost.fidelity import FIT_ROWS, framework_fit_selection, framework_of, load_runs
from pipewright.errors import ConfigError
from pipewright.hardware import accelerator
from pipewright.plan.spec_inputs import framework_efficiency, with_framework_defaults
from pipewright.runspec import defaults, with_values

MODEL = shlex.split(
    "--model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16 "
    "--mlp swiglu --gpu h100-sxm --nodes 1 --gpus-per-node 8 --global-batch-size 16 --tp 1 --pp 2 --dp 4 "
    "--recompute none"
)


@contextlib.contextmanager
def _registered(fw: frameworks.Framework):
    frameworks.register(fw, override=True)
    try:
        yield fw
    finally:
        frameworks.unregister(fw.name)


@pytest.mark.parametrize(
    ("flags", "kernels"),
    [
        (["--framework", "torchtitan"], "eager"),
        (["--kernels", "fused", "--framework", "torchtitan"], "fused"),
        (["--framework", "torchtitan", "--kernels", "compiled"], "compiled"),
        ([], None),
    ],
)
def test_defaults_fill_what_the_user_left_unset(flags, kernels):
    spec = with_framework_defaults(_parser((), "simulate").parse_args(["simulate", *flags]).spec)
    assert spec.framework.kernels == kernels
    assert spec.memory.fsdp_grad_sync == ("step" if flags else None)


def test_unknown_framework_is_one_line(capsys):
    assert main(["simulate", *MODEL, "--schedule", "1f1b", "--framework", "nemo-9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown --framework 'nemo-9'" in err and "torchtitan" in err


def test_calibration_is_the_stated_transform():
    base = default_efficiency(accelerator("h100-sxm"))
    fw = frameworks.Framework("probe", "a test entry", compute=0.5, overhead=1e-3)
    got = fw.efficiency(base)
    assert got == replace(base, gemm=base.gemm * 0.5, layer_overhead=base.layer_overhead + 1e-3)
    assert frameworks.framework("megatron").efficiency(base) is base
    with pytest.raises(ConfigError, match="cannot set recompute"):
        frameworks.Framework("bad", "", {"recompute": "full"})


def test_per_layer_overhead_adds_exactly_three_tau_per_layer_and_microbatch():
    """One GPU, four microbatches: every forward adds τ_f per layer and every backward 2τ_f."""
    one = shlex.split(
        "simulate --model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 "
        "--seq-len 16 --gpu h100-sxm --nodes 1 --gpus-per-node 1 --global-batch-size 4 --schedule 1f1b"
    )
    base = cli_json(one)["iteration_time_s"]
    with _registered(frameworks.Framework("probe", "a test entry", overhead=1e-3)):
        got = cli_json([*one, "--framework", "probe"])["iteration_time_s"]
    assert got - base == pytest.approx(4 * 4 * 3 * 1e-3, rel=1e-9)


def test_plan_prices_the_framework_as_simulate_does():
    flags = ["--framework", "torchtitan"]
    plan = ["plan", *MODEL, "--schedules", "1f1b", "--microbatch-sizes", "1", "--optimizer-sharding", "fsdp"]
    planned = cli_json([*plan, "--cp", "1", "--no-baselines", "--no-progress", *flags])["predicted"]
    simulated = cli_json(
        ["simulate", *MODEL, "--schedule", "1f1b", "--microbatch-size", "1", "--fsdp", *flags]
    )
    assert planned["iteration_time_s"] == pytest.approx(simulated["iteration_time_s"], rel=1e-12)
    default = cli_json(["simulate", *MODEL, "--schedule", "1f1b", "--microbatch-size", "1", "--fsdp"])
    assert simulated["iteration_time_s"] > default["iteration_time_s"]


def test_mixed_accelerators_are_refused_in_one_line():
    spec = with_values(defaults("simulate"), {("framework", "name"): "torchtitan"})
    with pytest.raises(ConfigError, match="one accelerator kind") as exc:
        framework_efficiency(spec, [accelerator("h100-sxm"), accelerator("a100-80gb")])
    assert "\n" not in str(exc.value)
    assert framework_efficiency(defaults("simulate"), [accelerator("h100-sxm")]) is None


def test_fit_rows_are_the_rule_and_at_most_half():
    runs = load_runs()
    for name in frameworks.names():
        fw = frameworks.framework(name)
        mine = [r for r in runs if framework_of(r) == name]
        if name == frameworks.DEFAULT_FRAMEWORK:
            assert fw.neutral and not fw.fitted_on
            continue
        assert fw.fitted_on == framework_fit_selection(runs, name)
        assert 0 < len(fw.fitted_on) <= len(mine) / 2
        assert set(fw.fitted_on) <= FIT_ROWS
