"""``pipewright train``: bad input is one line before any worker starts; the same seed gives the same
losses whatever the layout or schedule; a run stopped and resumed equals a straight run; the four
output files exist. Three 2-process runs in all (module-scoped fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipewright.cli import main
from pipewright.data import open_dataset
from pipewright.data.tokens import write_tokens
from pipewright.models.gpt import build_full, loss_fn
from pipewright.models.spec import ModelSpec

TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--microbatch-size", "2"]
TINY += ["--microbatches", "4", "--eval-every", "5", "--no-progress", "--seed", "3", "--lr", "0.01"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 400, dtype=np.uint8)
    write_tokens(path, text.astype(np.int64), vocab_size=256)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """A: 10 straight steps (1f1b, uniform layout). B: same seed, gpipe and an uneven layout, stopped
    after 5 steps; then resumed with A's schedule and layout for the other 5."""
    root = tmp_path_factory.mktemp("runs")
    common = ["train", *TINY, "--data", data, "--steps", "10"]
    a, b = root / "a", root / "b"
    assert main([*common, "--out", str(a)]) == 0
    assert (
        main([*common, "--out", str(b), "--schedule", "gpipe", "--layout", "Et*3|tL", "--stop-after", "5"])
        == 0
    )
    b_first = _losses(b)
    assert main([*common, "--out", str(b), "--resume"]) == 0
    return a, b, b_first


@pytest.mark.slow
def test_outputs_exist_and_loss_falls(runs, capsys):
    a, _, _ = runs
    for name in ("metrics.jsonl", "loss.png", "timeline.png", "trace.json"):
        assert (a / name).is_file() and (a / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(10))
    for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "bubble_fraction"):
        assert all(key in r for r in records), key
    assert [r["step"] for r in records if "val_loss" in r] == [4, 9]
    assert 0.0 <= records[-1]["bubble_fraction"] < 1.0
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # a repeated sentence is quickly learned
    trace = json.loads((a / "trace.json").read_text())
    assert any(e.get("name", "").endswith("F0") for e in trace["traceEvents"])
    assert (a / "checkpoints" / "latest").read_text().strip() == "step_10"


@pytest.mark.slow
def test_same_seed_same_losses_whatever_layout_and_schedule(runs, data):
    a, _, b_first = runs
    assert len(b_first) == 5
    np.testing.assert_allclose(b_first, _losses(a)[:5], rtol=1e-6)
    # and the first loss (before any update) is the single-process model's on the same global batch
    spec = ModelSpec("tiny", layers=4, hidden=32, heads=4, vocab=256, seq_len=16)
    x, y = open_dataset(data, progress=False).batch("train", 0, 8, 16, 3)
    with torch.no_grad():
        ref = loss_fn(build_full(spec, seed=3)(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert _losses(a)[0] == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_stop_and_resume_equals_a_straight_run(runs):
    a, b, _ = runs
    np.testing.assert_allclose(_losses(b), _losses(a), rtol=1e-6)
    assert (b / "checkpoints" / "latest").read_text().strip() == "step_10"
    assert (b / "checkpoints" / "step_5" / "meta.json").is_file()


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipewright: error: ") and "\n" not in err, err
    return err


@pytest.mark.slow
def test_resume_from_another_model_is_one_line(runs, capsys, data):
    a, _, _ = runs
    err = _error(capsys, ["train", *TINY, "--data", data, "--hidden", "64", "--out", str(a), "--resume"])
    assert "another model" in err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--pp", "4", "--layers", "2"], "only 2 layers"),
        (
            ["--pp", "2", "--virtual", "2", "--schedule", "interleaved-1f1b", "--microbatches", "1"],
            "microbatches",
        ),
        (["--data", "/nonexistent/tokens.bin"], "does not exist"),
        (["--nproc", "3"], "--nproc 3"),
        (["--layout", "Et|tL"], "transformer layers"),
        (["--layout", "Et|tX"], "cannot read"),
        (["--schedule", "nope"], "unknown schedule"),
        (["--optimizer", "lamb"], "unknown optimizer"),
        (["--tp", "3"], "not divisible by --tp 3"),
        (["--heads", "5"], "divisible"),
    ],
)
def test_bad_input_is_one_line(capsys, data, extra, expected):
    assert expected in _error(capsys, ["train", *TINY, "--data", data, *extra])


def test_bad_config_key_and_resume_without_checkpoint(capsys, data, tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("pp = 2\nmicro_batches = 4\n")
    assert "micro_batches" in _error(capsys, ["train", "--config", str(config)])
    config.write_text("[train]\npp = 2\nsteps = 3\n")
    assert "no checkpoint" in _error(capsys, ["train", "--config", str(config), "--data", data, "--resume",
                                              "--out", str(tmp_path / "none")])  # fmt: skip
