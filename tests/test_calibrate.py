"""``pipewright profile --calibration``: the file has the agreed format, its GEMM entries are the model's
shapes with consistent FLOP rates, the device maps to a hardware preset (or a one-line error), and
several processes add the link figures."""

from __future__ import annotations

import json

import pytest

from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.models.presets import resolve_model
from pipewright.runtime.profiling.measure_calibration import (
    FORMAT,
    CalibrationOptions,
    calibrate,
    gemm_shapes,
    preset_for,
)

TINY = resolve_model("gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32)


def test_gemm_shapes_are_the_layers_products():
    shapes = gemm_shapes(TINY, (1, 2), tp=2)
    h, f, bs = 64, 256, 32
    assert (bs, 3 * h // 2, h) in shapes  # QKV forward
    assert (bs, f // 2, h) in shapes and (bs, h, f // 2) in shapes  # MLP up and down
    assert (bs, 256 // 2, h) in shapes  # output layer
    assert (f // 2, h, bs) in shapes  # MLP weight gradient: k = tokens
    assert (2 * bs, h, h // 2) in shapes  # the second microbatch size
    assert len(shapes) == len(set(shapes))


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("Tesla V100-SXM2-32GB", "v100"),
    ],
)
def test_device_names_map_to_presets(name, preset):
    assert preset_for(name) == preset


def test_an_unknown_device_asks_for_gpu():
    with pytest.raises(ConfigError, match="pass --gpu NAME"):
        preset_for("Some Future Accelerator 9000")
    assert preset_for("Some Future Accelerator 9000", "a100-80gb") == "a100-80gb"
    with pytest.raises(ConfigError, match="not a known accelerator"):
        preset_for("x", "tpu-v9")


def test_cli_writes_a_calibration_on_cpu(tmp_path, capsys):
    out = tmp_path / "cal.json"
    argv = ["profile", "--calibration", str(out), "--model", "gpt", "--layers", "2", "--hidden", "64"]
    argv += ["--heads", "4", "--vocab", "256", "--seq-len", "32", "--microbatch-size", "1"]
    assert main([*argv, "--repeats", "2", "--warmup", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and data["accelerator"] == "cpu" and data["dtype"] == "fp32"
    assert {(g["m"], g["n"], g["k"]) for g in data["gemm"]} == set(gemm_shapes(TINY, (1,)))
    for g in data["gemm"]:
        assert g["dtype"] == "fp32" and g["seconds"] > 0
        assert g["tflops"] == pytest.approx(2 * g["m"] * g["n"] * g["k"] / g["seconds"] / 1e12)
    assert data["memory_bandwidth"] > 0 and "links" not in data
    assert "calibration of cpu" in capsys.readouterr().out
    from pipewright.cost.calibration import load_calibration

    cal = load_calibration(out)  # the cost model's reader takes it
    assert cal.accelerator == "cpu" and len(cal.gemm) == len(data["gemm"])


def test_profile_needs_one_output(capsys):
    assert main(["profile"]) == 2
    assert "--out FILE (a profile) or --calibration FILE" in capsys.readouterr().err


def test_two_processes_measure_the_link():
    options = CalibrationOptions(
        TINY, repeats=2, warmup=1, processes=2, bandwidth_bytes=1 << 20, link_bytes=1 << 16
    )
    data = calibrate(options)
    link = data["links"]["intra_node"]
    assert link["bandwidth"] > 0 and link["latency"] > 0
    assert "inter_node" not in data["links"]  # one node
