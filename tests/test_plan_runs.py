"""Plans that run: a plan passes every configuration check of ``train --plan`` (vocabulary padded as
Megatron pads it, every tensor-parallel split), ``simulate --plan`` reproduces the plan's iteration time
exactly, and out-of-range numbers or sizes get one line instead of a search that never ends."""

from __future__ import annotations

import json

import pytest

from pipewright.cli import build_parser, main
from pipewright.models.presets import resolve_model
from pipewright.plan.problem import padded_vocab, tp_splits

CLUSTER = ["--gpu", "a100-80gb", "--nodes", "128", "--gpus-per-node", "8"]


def test_padded_vocab_is_megatrons():
    # Megatron-LM pads GPT-2's 50257 to 50304 at t = 1 (make-vocab-size-divisible-by 128)
    assert padded_vocab(50257, 1) == 50304
    assert padded_vocab(50257, 4) == 50688
    assert padded_vocab(51200, 8) == 51200
    assert all(padded_vocab(v, t) % (128 * t) == 0 for v in (1, 127, 50257) for t in (1, 2, 3, 8))


def test_tp_splits_checks_what_train_checks():
    gpt = resolve_model("gpt3-175b")  # 96 heads, ffn 49152, seq 2048
    assert tp_splits(gpt, 8) and not tp_splits(gpt, 5)
    llama = resolve_model("llama", layers=2, hidden=512, heads=8, kv_heads=2, seq_len=128, vocab=256)
    assert tp_splits(llama, 2) and not tp_splits(llama, 4)  # 2 kv heads do not split over 4


@pytest.fixture(scope="module")
def gpt3_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = ["plan", "--model", "gpt3-175b", *CLUSTER, "--global-batch-size", "1536"]
    assert main([*argv, "--no-baselines", "--no-progress", "-o", str(out)]) == 0
    return out


def test_gpt3_plan_passes_train_checks(gpt3_plan, tmp_path, monkeypatch):
    import shutil

    from pipewright.cli.train import config_from_args
    from pipewright.training import prepare

    # the 1024 processes are torchrun's on a cluster whose --out has room for a 175B checkpoint; this
    # machine's disk (checked by prepare as well) is not what the plan is tested for
    free = shutil.disk_usage(tmp_path)._replace(free=2**45)
    monkeypatch.setattr("pipewright.files.shutil.disk_usage", lambda _path: free)
    args = build_parser().parse_args(["train", "--plan", str(gpt3_plan), "--out", str(tmp_path / "run")])
    config = config_from_args(args)
    run = prepare(config, world_size=1024)  # every check before the workers are spawned
    plan = json.loads(gpt3_plan.read_text())
    assert run.spec.vocab == plan["model"]["padded_vocab"] == padded_vocab(50257, plan["tp"])
    assert run.schedule.num_stages == plan["pp"] * plan["virtual"]
    assert config.world_size == 1024


def test_simulate_plan_reproduces_the_plans_time(gpt3_plan, capsys):
    capsys.readouterr()
    assert main(["simulate", "--plan", str(gpt3_plan), *CLUSTER, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = json.loads(gpt3_plan.read_text())
    assert plan["grad_reduce"] == "overlap"
    assert report["iteration_time_s"] == plan["predicted"]["iteration_time_s"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--memory-limit", "-5"], "--memory-limit must be a positive number (got -5.0)"),
        (["--memory-limit", "inf"], "--memory-limit must be a positive number (got inf)"),
        (["--global-batch-size", "0"], "--global-batch-size must be at least 1 (got 0)"),
        (["--max-tp", "0"], "--max-tp must be at least 1 (got 0)"),
        (["--tp", "-2"], "--tp must be at least 1 (got -2)"),
        (["--finalists", "0"], "--finalists must be at least 1 (got 0)"),
        (["--cores", "0"], "--cores must be a positive number (got 0.0)"),
        (["--microbatch-sizes", "2,-1"], "--microbatch-sizes takes comma-separated positive integers"),
        (["-o", "/nonexistent-folder/plan.json"], "folder /nonexistent-folder does not exist"),
    ],
)
def test_out_of_range_numbers_get_one_line(flags, message, capsys):
    argv = ["plan", "--model", "gpt3-175b", *CLUSTER, "--global-batch-size", "1536", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_huge_global_batch_is_refused(capsys):
    # the search skips layouts too large to simulate instead of simulating them until killed
    argv = ["plan", "--model", "gpt3-175b", *CLUSTER, "--global-batch-size", "100000000", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-actions 2,000,000" in err and "lower --global-batch-size" in err


def test_a_calibration_of_another_gpu_is_one_line(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    gemm = [{"m": 8, "n": 8, "k": 8, "dtype": "fp32", "seconds": 1e-6, "tflops": 0.001}]
    cal.write_text(json.dumps({"format": "pipewright-calibration/1", "accelerator": "cpu", "dtype": "fp32",
                               "gemm": gemm, "memory_bandwidth": 1e10}))  # fmt: skip
    argv = ["plan", "--model", "gpt3-175b", *CLUSTER, "--global-batch-size", "1536"]
    assert main([*argv, "--calibration", str(cal)]) == 2
    err = capsys.readouterr().err
    assert "measured on 'cpu', not on --gpu a100-80gb" in err and err.count("\n") == 1


def test_a_custom_decoders_plan_simulates_alike(tmp_path, capsys):
    out = tmp_path / "plan.json"
    model = ["--model", "llama", "--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4"]
    model += ["--vocab", "32000", "--seq-len", "1024", "--mlp", "swiglu", "--no-bias"]
    node = ["--gpu", "a100-80gb", "--nodes", "1", "--gpus-per-node", "8"]
    argv = ["plan", *model, *node, "--global-batch-size", "32", "--no-baselines", "--no-progress"]
    assert main([*argv, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), *node, "--json"]) == 0
    plan = json.loads(out.read_text())
    assert plan["model"]["kv_heads"] == 4 and plan["model"]["bias"] is False
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] == plan["predicted"]["iteration_time_s"]
