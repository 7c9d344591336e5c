"""The pricing commands read the RunSpec: their parsed line is the spec (and the function to run)
alone; a plan file becomes the spec's values (its layout over the flags, a cost-model input given
over the plan's); ``calibrate``'s spec path prices a measured run to the digit as the command line
does."""

from __future__ import annotations

import pytest

from _cli_json import cli_json
from pipewright.cli import _parser, main
from pipewright.cli.calibrate import flag_setup, predict_all
from pipewright.cost.measured import vtrain_runs
from pipewright.plan.apply import simulate_plan

PRICING = ("simulate", "plan", "export-plan", "calibrate", "profile")


@pytest.mark.parametrize("command", (*PRICING, "train", "check"))
def test_the_parsed_line_is_the_spec_and_nothing_by_option_name(command):
    parser = _parser((), command)
    top = {a.dest for a in parser._actions}  # the top level's (--verbose, the command's name)
    parsed = vars(parser.parse_args([command, "--overwrite"]))
    older = {"train_toml"} if command in ("train", "check") else set()  # (a flat-key train TOML's path)
    assert set(parsed) - top == {"spec", "given", "func", *older}  # given: the paths of the flags given
    assert parsed["spec"].output.overwrite is True


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = ["plan", "--model", "gpt-small-cpu", "--layers", "4", "--gpu", "cpu", "--gpus-per-node", "4",
            "--global-batch-size", "8", "--schedules", "1f1b", "--no-baselines", "--no-progress",
            "-o", str(path)]  # fmt: skip
    assert main(argv) == 0
    return path


def test_a_plan_becomes_the_specs_values(plan_file, capsys):
    capsys.readouterr()
    parse = _parser((), "simulate").parse_args
    given = ["simulate", "--plan", str(plan_file), "--gpu", "cpu", "--gpus-per-node", "4"]
    spec, plan = simulate_plan(parse([*given, "--tp", "4", "--kernels", "eager"]).spec)
    d = plan.plan.data
    par = spec.parallelism
    assert (par.tp, par.pp, par.dp, spec.schedule.name) == (d["tp"], d["pp"], d["dp"], d["schedule"])
    assert (spec.batch.microbatch_size, spec.batch.global_batch_size) == (d["microbatch_size"], 8)
    assert (spec.model.model, spec.model.layers) == ("gpt-small-cpu", 4)  # unset: the plan's model
    assert d["kernels"] == "fused" and spec.framework.kernels == "eager"  # given: over the plan's
    assert plan.layout == plan.plan.chunk_layers() and plan.devices == tuple(d["devices"])
    # the spec path prints what the flags the plan states print
    flags = ["--model", "gpt-small-cpu", "--layers", "4", "--gpu", "cpu", "--gpus-per-node", "4"]
    flags += ["--tp", str(d["tp"]), "--pp", str(d["pp"]), "--dp", str(d["dp"]), "--schedule", d["schedule"]]
    flags += ["--microbatch-size", str(d["microbatch_size"]), "--global-batch-size", "8"]
    flags += ["--recompute", d["recompute"], "--grad-reduce", d["grad_reduce"], "--attention", d["attention"]]
    flags += ["--vocab", str(d["model"]["padded_vocab"])] + (
        ["--shard-optimizer"] if d["optimizer_sharding"] == "zero1" else []
    )
    by_plan = cli_json([*given])
    by_flags = cli_json(["simulate", *flags])
    assert by_plan["iteration_time_s"] == by_flags["iteration_time_s"]


def test_calibrate_prices_a_run_as_the_command_line_does():
    setup = ["--gpu", "a100-80gb", "--vocab", "50257", "--framework", "deepspeed-megatron", "--dtype", "fp16"]
    setup += ["--attention", "eager", "--recompute", "full", "--grad-reduce", "after"]
    run = vtrain_runs()[7]
    flags = [
        "--model",
        "gpt",
        "--layers",
        str(run.layers),
        "--hidden",
        str(run.hidden),
        "--heads",
        str(run.heads),
    ]
    flags += ["--seq-len", str(run.seq_len), "--nodes", str(-(-run.gpus // 8))]
    flags += ["--gpus-per-node", str(min(8, run.gpus)), "--tp", str(run.tp), "--pp", str(run.pp)]
    flags += ["--dp", str(run.dp), "--schedule", "1f1b", "--microbatch-size", str(run.microbatch)]
    flags += ["--global-batch-size", str(run.global_batch)]
    simulated = cli_json(["simulate", *flags, *setup])["iteration_time_s"]
    assert predict_all([run], flag_setup(setup)) == [simulated]
