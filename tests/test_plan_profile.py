"""`pipewright plan --profile`: a measured cost table as the planner's model input."""

from __future__ import annotations

import json

import pytest

from pipewright.cli import main

# a heavy output layer (≈ 3 layers' time): the planner moves layers off the last stage
HEADER = "# model=gpt-small-cpu layers=8 hidden=128 heads=4 ffn_hidden=512 vocab=8192 seq_len=128 tp=1"
PROFILE = (
    HEADER
    + """ device=cpu dtype=fp32
layer_type,microbatch_size,kind,seconds,bytes
embedding,1,F,0.0002,65536
embedding,1,B,0.0004,
layer,1,F,0.010,900000
layer,1,B,0.020,
output,1,F,0.030,4194304
output,1,B,0.060,
embedding,1,PARAMS,0,16000000
layer,1,PARAMS,0,3200000
output,1,PARAMS,0,16000000
layer,1,MESSAGE,0.0005,65536
"""
)


def test_plan_from_a_profile_moves_layers_and_simulates_alike(tmp_path, capsys) -> None:
    prof, plan_path = tmp_path / "profile.csv", tmp_path / "plan.json"
    prof.write_text(PROFILE)
    argv = ["plan", "--profile", str(prof), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2",
            "--pp", "2", "--global-batch-size", "8", "--schedules", "1f1b", "--no-progress",
            "-o", str(plan_path)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = json.loads(plan_path.read_text())
    model = {"name": "gpt-small-cpu", "layers": 8, "hidden": 128, "heads": 4, "ffn_hidden": 512}
    assert plan["model"].items() >= {**model, "vocab": 8192, "seq_len": 128, "padded_vocab": 8192}.items()
    assert (plan["tp"], plan["pp"], plan["microbatch_size"], plan["recompute"]) == (1, 2, 1, "none")
    # F+B per microbatch: stage 0 = 0.0006 + 0.03·n, stage 1 = 0.03·(8 − n) + 0.09: 0.18 s at n = 5 or 6
    # (the simulation prefers 6), 0.21 s uniform
    assert plan["layout"] == "Et*6|t*2L"
    assert "uniform" in text and "megatron" not in text  # cluster rules are not applied to a profile
    assert plan["baselines"][0]["layout"] == "Et*4|t*4L"
    assert plan["baselines"][0]["iteration_time_s"] > 1.15 * plan["predicted"]["iteration_time_s"]
    # `simulate --plan` on the same profile predicts what the planner did
    assert main(["simulate", "--plan", str(plan_path), "--profile", str(prof), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["iteration_time_s"] == pytest.approx(plan["predicted"]["iteration_time_s"], rel=1e-9)


def test_profile_errors_are_one_line(tmp_path, capsys) -> None:
    prof = tmp_path / "profile.csv"
    prof.write_text(PROFILE)
    base = ["plan", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8",
            "--no-progress"]  # fmt: skip
    assert main([*base, "--profile", str(prof), "--model", "gpt-tiny"]) == 2
    assert "give --model or --profile, not both" in capsys.readouterr().err
    assert main([*base, "--profile", str(prof), "--microbatch-sizes", "2,4"]) == 2
    assert "the profile measured microbatch sizes 1" in capsys.readouterr().err
    assert main(base) == 2
    assert "needs --model NAME (or --profile FILE)" in capsys.readouterr().err
