"""Each thing a new user met on the commands other than ``train`` — data lost, wrong results with exit
0, tracebacks, hangs, unclear messages — reproduced as it was met and checked as it must be now: the
input kept, a one-line error naming the file or flag (and a value that works), a non-zero status.
Everything runs in-process (``pipewright.cli.main``); Ctrl-C is tests/test_interrupt.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipewright.cli import main
from pipewright.data import open_dataset
from pipewright.data.tokens import write_tokens

CALIBRATION = {
    "format": "pipewright-calibration/1", "accelerator": "h100-sxm", "dtype": "bf16",
    "gemm": [{"m": 4096, "n": 4096, "k": 4096, "seconds": 0.0002, "tflops": 687.2}],
    "memory_bandwidth": 2.9e12,
}  # fmt: skip
SIMULATE = ["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--tp", "8", "--global-batch-size", "8"]
SIMULATE += ["--schedule", "1f1b", "--allow-no-fit"]
TINY = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq-len",
    "16",
    "--pp",
    "2",
    "--eval-every",
    "0",
]


def _error(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("pipewright") and "error:" in lines[-1], lines
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


# -- data lost --------------------------------------------------------------------------------------------


def test_data_prepare_never_writes_over_its_input_or_into_its_folder(capsys, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "00.txt").write_text("the cat")
    model = _tokenizer(tmp_path / "model")
    line = _error(
        capsys, ["data", "prepare", str(corpus), "--tokenizer", str(model), "-o", str(corpus / "00.txt")]
    )
    assert "is also this command's input" in line or "inside the input folder" in line
    assert (corpus / "00.txt").read_text() == "the cat" and sorted(p.name for p in corpus.iterdir()) == [
        "00.txt"
    ]


def test_export_plan_never_replaces_the_plan_it_reads(capsys, tmp_path):
    from test_fuzz_inputs import PLAN_JSON

    plan = tmp_path / "plan.json"
    plan.write_text(PLAN_JSON)
    line = _error(capsys, ["export-plan", str(plan), "--to", "megatron", "-o", str(plan)])
    assert "is also this command's input" in line and plan.read_text() == PLAN_JSON


# -- wrong results with exit 0 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("tflops", -42.0, "'tflops' must be a positive number"),
        ("seconds", float("nan"), "'seconds' must be a positive number"),
        ("memory_bandwidth", float("inf"), "'memory_bandwidth' must be a positive number"),
        ("tflops", "fast", "'tflops' must be a positive number"),
    ],
)
def test_calibration_values_are_checked_by_simulate_and_plan(capsys, tmp_path, field, value, words):
    data = json.loads(json.dumps(CALIBRATION))
    (data if field == "memory_bandwidth" else data["gemm"][0])[field] = value
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    line = _error(capsys, [*SIMULATE, "--calibration", str(path)])
    assert words in line and str(path) in line
    plan = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--global-batch-size", "8", "--no-progress"]
    assert words in _error(capsys, [*plan, "--calibration", str(path)])


def test_a_binary_calibration_is_one_line(capsys, tmp_path):
    path = tmp_path / "cal.json"
    path.write_bytes(b"\xff\xfe\x00garbage\x80")
    assert "is not UTF-8" in _error(capsys, [*SIMULATE, "--calibration", str(path)])


def test_a_token_file_is_known_by_its_sidecar_whatever_its_name(tmp_path):
    write_tokens(tmp_path / "t.tok", np.arange(600) % 300, vocab_size=300)
    assert open_dataset(tmp_path / "t.tok").vocab_size == 300  # not read as text (vocabulary 256)


def test_binary_and_too_short_corpora_are_refused_by_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEWRIGHT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "nul.txt").write_bytes(bytes(17))
    (tmp_path / "short.txt").write_text("hello world!")
    train = ["train", "--dry-run", *TINY, "--data"]
    assert "is binary" in _error(capsys, [*train, str(tmp_path / "nul.txt")])
    line = _error(capsys, [*train, str(tmp_path / "short.txt")])
    assert "fewer than --seq-len + 1 = 17" in line and "--seq-len 10 or less" in line


def test_dry_run_checks_the_hf_config_values(capsys, tmp_path):
    config = {"model_type": "llama", "hidden_size": -64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = _error(capsys, ["train", "--dry-run", "--hf-model", str(tmp_path), "--pp", "2", "--seq-len", "16"])
    assert "hidden must be an integer" in line and "config.json" in line


def test_simulate_exits_non_zero_when_the_layout_does_not_fit(capsys):
    argv = ["simulate", "--model", "llama3-70b", "--gpu", "h100-sxm", "--pp", "4", "--tp", "2"]
    argv += ["--global-batch-size", "16", "--schedule", "1f1b"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "--allow-no-fit" in captured.err
    assert "peak memory (the fit check) = total - comm bufs - reserve" in captured.out
    assert main([*argv, "--allow-no-fit"]) == 0


# -- tracebacks and hangs ------------------------------------------------------------------------------


def test_a_feature_module_that_raises_is_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_feature.py").write_text("raise RuntimeError('boom\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _error(capsys, ["train", "--feature", "broken_feature:FEATURE", "--dry-run"])
    assert "importing broken_feature raised RuntimeError: boom" in line and "-v" in line
    sys.modules.pop("broken_feature", None)
    assert main(["-v", "train", "--feature", "broken_feature:FEATURE", "--dry-run"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--nodes", "1000000", "--dp", "1000000",
          "--global-batch-size", "1000000", "--schedule", "1f1b"], "--nodes"),
        (["plan", "--model", "llama3-405b", "--gpu", "h100-sxm", "--nodes", "100000", "--global-batch-size",
          "1024"], "--nodes"),
        (["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--tp", "3", "--global-batch-size", "64"],
         "--tp one of 1, 2, 4, 8"),
    ],
)  # fmt: skip
def test_sizes_are_refused_in_a_second_naming_the_flag(capsys, argv, flag):
    start = time.monotonic()
    assert flag in _error(capsys, argv)
    assert time.monotonic() - start < 1.0


def test_train_out_under_proc_says_it_cannot_be_written(capsys, tmp_path):
    write_tokens(tmp_path / "t.bin", np.arange(400) % 256, vocab_size=256)
    line = _error(
        capsys, ["train", "--dry-run", *TINY, "--data", str(tmp_path / "t.bin"), "--out", "/proc/x"]
    )
    assert "cannot create a file in /proc" in line and "0.00 GiB" not in line


# -- unclear --------------------------------------------------------------------------------------------


def test_file_errors_name_the_file(capsys, tmp_path):
    assert "is a folder" in _error(capsys, ["simulate", "--profile", str(tmp_path), "--schedule", "1f1b"])
    profile = tmp_path / "p.json"
    profile.write_text('{"format": "pipewright-profile", "rows": [{"layer_type": "layer"}]}')
    assert str(profile) in _error(capsys, ["simulate", "--profile", str(profile), "--schedule", "1f1b"])


def test_long_values_are_cut(capsys):
    line = _error(capsys, ["simulate", "--schedule", "x" * 100_000, "--stages", "2", "--microbatches", "2"])
    assert len(line) < 400 and "100,000 characters" in line
    assert len(_usage_error(capsys, ["simulate", "--schedule", "1f1b", "--stages", "x" * 100_000])) < 400


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_bad_integer_is_one_line_not_the_usage(capsys):
    line = _usage_error(capsys, ["simulate", "--schedule", "1f1b", "--stages", "x"])
    assert "--stages" in line and "invalid int value: 'x'" in line and "--help" in line


def test_help_states_the_real_moe_default_and_lists_the_moe_presets(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "experts each token is routed to (default: the preset's, else 2)" in text
    assert "mixture of experts: mixtral-8x7b, deepseek-v3" in text


def test_resume_and_save_messages_say_what_differs_and_what_is_left(tmp_path):
    from pipewright.models.presets import resolve_model
    from pipewright.runtime.checkpointing.resume_check import model_difference
    from pipewright.runtime.checkpointing.save_errors import save_failed

    spec = resolve_model("gpt", layers=2, hidden=32, heads=4, seq_len=16, vocab=256)
    meta = {"config": {"model": "gpt", "layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "data": "a.bin"}}
    current = {"data": "b.bin", "tokenizer": "byte"}
    assert "--data a.bin (this run: b.bin)" in model_difference(meta, spec, 1, current)
    (tmp_path / "checkpoints").mkdir()
    assert "no earlier checkpoint" in save_failed(tmp_path / "checkpoints" / "step_2", "disk full")
