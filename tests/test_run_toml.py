"""One RunSpec file through the commands: ``plan -o run.toml`` writes the run it chose (and its search
report beside it), ``simulate --config run.toml`` prints the plan's time to the digit, and the spec in
the file round-trips through TOML and flags unchanged; an old plan JSON still loads."""

from __future__ import annotations

import json

import pytest

from pipewright.cli import main
from pipewright.runspec import dump_toml, load_toml, loads_toml, spec_from_args, spec_to_argv

PLAN = ["plan", "--model", "gpt-small-cpu", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2",
        "--global-batch-size", "8", "--schedules", "1f1b", "--no-baselines", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    assert main([*PLAN, "-o", str(folder / "run.toml")]) == 0
    return folder


def _time(capsys, argv: list[str]) -> float:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["iteration_time_s"]


def test_simulate_reads_the_plans_spec_to_the_digit(planned, capsys, monkeypatch):
    report = json.loads((planned / "run.plan.json").read_text())
    predicted = report["predicted"]["iteration_time_s"]
    assert _time(capsys, ["simulate", "--config", str(planned / "run.toml"), "--json"]) == predicted
    monkeypatch.chdir(planned)  # the report is found beside the file, from any folder
    assert _time(capsys, ["simulate", "--config", "run.toml", "--json"]) == predicted
    # the old plan JSON, as before
    cluster = ["--gpu", "cpu", "--gpus-per-node", "2"]
    assert _time(capsys, ["simulate", "--plan", "run.plan.json", *cluster, "--json"]) == predicted


def test_the_file_holds_the_plans_choices(planned):
    report = json.loads((planned / "run.plan.json").read_text())
    spec = load_toml(planned / "run.toml", "simulate")
    p = spec.parallelism
    assert (p.tp, p.pp, p.dp, p.layout, spec.schedule.name) == (
        report["tp"], report["pp"], report["dp"], report["layout"], report["schedule"]
    )  # fmt: skip
    assert (spec.batch.microbatches, spec.batch.global_batch_size) == (report["microbatches"], 8)
    assert spec.output.out is None  # what plan wrote is not part of the run


@pytest.mark.parametrize("command", ["simulate", "train", "check"])
def test_the_spec_round_trips(planned, command):
    from test_runspec import spec_parser

    spec = load_toml(planned / "run.toml", command)
    assert loads_toml(dump_toml(spec), command) == spec
    assert spec_from_args(spec_parser(command).parse_args(spec_to_argv(spec, command)), command) == spec


def test_flags_override_the_file(planned, capsys):
    capsys.readouterr()
    assert main(["simulate", "--config", str(planned / "run.toml"), "--json", "--iterations", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["iterations"] == 3


def test_train_and_check_read_the_same_file(planned, capsys):
    from pipewright.cli import build_parser
    from pipewright.cli.train import config_from_args

    report = json.loads((planned / "run.plan.json").read_text())
    capsys.readouterr()
    assert main(["train", "--config", str(planned / "run.toml"), "--dry-run"]) == 0
    assert "no worker started (--dry-run)" in capsys.readouterr().out
    for command in ("train", "check"):
        args = build_parser().parse_args([command, "--config", str(planned / "run.toml"), "--steps", "2"])
        config = config_from_args(args)
        assert (config.tp, config.pp, config.dp, config.microbatches, config.steps) == (
            report["tp"], report["pp"], report["dp"], report["microbatches"], 2
        )  # fmt: skip


def test_export_plan_reads_the_file(planned, capsys):
    capsys.readouterr()
    assert main(["export-plan", str(planned / "run.plan.json"), "--to", "megatron"]) == 0
    from_json = capsys.readouterr().out
    assert main(["export-plan", str(planned / "run.toml"), "--to", "megatron"]) == 0
    assert capsys.readouterr().out == from_json and "MEGATRON_ARGS=(" in from_json


def test_train_reads_the_planned_cluster_and_global_batch(planned, capsys):
    from pipewright.cli import build_parser
    from pipewright.cli.train import config_from_args
    from pipewright.errors import ConfigError

    run = ["train", "--config", str(planned / "run.toml")]
    config = config_from_args(build_parser().parse_args([*run, "--gpu", "h100-sxm"]))
    assert (config.gpu, config.global_batch) == ("h100-sxm", 8)
    args = build_parser().parse_args(["train", "--global-batch-size", "32", "--microbatch-size", "2"])
    assert config_from_args(args).microbatches == 16  # 32 ÷ (b 2 × dp 1)
    with pytest.raises(ConfigError, match=r"planned for 1 × 2 = 2 devices .* = 4 processes"):
        config_from_args(build_parser().parse_args([*run, "--pp", "2"]))
    with pytest.raises(ConfigError, match="--global-batch-size 9 is not a multiple of"):
        config_from_args(build_parser().parse_args(["train", "--global-batch-size", "9"]))
    capsys.readouterr()
    assert main([*run, "--gpu", "h100-sxm", "--dry-run"]) == 0
    assert "fits a h100-sxm (80 GiB) per process, by this estimate" in capsys.readouterr().out


def test_an_older_train_file_still_reads(tmp_path):
    from pipewright.cli import build_parser
    from pipewright.cli.train import config_from_args

    flat, table = tmp_path / "flat.toml", tmp_path / "table.toml"
    flat.write_text("steps = 3\npp = 4\nmicrobatches = 8\n")
    table.write_text("[train]\nsteps = 3\npp = 4\n")
    config = config_from_args(build_parser().parse_args(["train", "--config", str(flat)]))
    assert (config.steps, config.pp, config.microbatches) == (3, 4, 8)
    config = config_from_args(build_parser().parse_args(["train", "--config", str(table), "--pp", "2"]))
    assert (config.steps, config.pp) == (3, 2)
