"""The disk pre-check's checkpoint size against a real checkpoint, and what a failed save says it leaves.

A 2-layer GPT trained one step at pp = 2 (forked workers): the estimate
(:func:`pipewright.runtime.setup.size_check.checkpoint_bytes`) is within 10 % of the ``step_1`` folder's bytes
(weights, AdamW's moments and step counts, random-generator states, DCP's metadata, meta.json).
"""

from __future__ import annotations

from pathlib import Path

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.runtime.checkpointing.save_errors import kept
from pipewright.runtime.setup.size_check import estimate
from pipewright.training import prepare


def test_estimate_within_ten_percent_of_a_real_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "16"]
    args += ["--pp", "2", "--steps", "1", "--warmup", "0", "--eval-every", "0", "--out", str(out)]
    with forked_cli_launches():
        assert main(["train", *args]) == 0
    folder = out / "checkpoints" / "step_1"
    real = sum(f.stat().st_size for f in folder.iterdir())
    from pipewright.runtime.setup.config import TrainConfig

    config = TrainConfig(
        model="gpt", layers=2, hidden=64, heads=2, seq_len=16, pp=2, steps=1, out=str(tmp_path / "other")
    )
    est = estimate(prepare(config)).checkpoint_bytes
    assert abs(est - real) / real < 0.10, (est, real)


def test_failed_save_names_an_earlier_checkpoint_only_when_one_exists(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_2.tmp").mkdir(parents=True)
    (checkpoints / "step_1").mkdir()  # a save that never finished: no meta.json
    assert kept(checkpoints / "step_2") == "there is no earlier checkpoint"
    (checkpoints / "step_1" / "meta.json").write_text("{}")
    assert kept(checkpoints / "step_2") == "the previous checkpoint is kept"
