"""``pipewright train`` with tensor parallelism: ``--tp 2 --pp 2`` (plain, and with
``--sequence-parallel``) trains to the same per-step losses as ``--tp 1 --pp 2`` with the same seed
(the optimizer steps in between, so all three steps agree only if the gradients do); the flags that
cannot go together are one-line errors. Three runs (2, 4 and 4 forked processes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.data.tokens import write_tokens

TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--microbatch-size", "2"]
TINY += ["--microbatches", "4", "--eval-every", "0", "--no-progress", "--no-artifacts", "--seed", "5"]
TINY += ["--pp", "2", "--steps", "3", "--vocab", "256"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    write_tokens(path, np.random.default_rng(1).integers(0, 256, 4_000), vocab_size=256)
    return str(path)


@pytest.mark.slow
def test_tp2_with_and_without_sequence_parallelism_equals_tp1(tmp_path, data):
    runs = {"tp1": ["--tp", "1"], "tp2": ["--tp", "2"], "tp2+sp": ["--tp", "2", "--sequence-parallel"]}
    losses = {}
    for name, flags in runs.items():
        out = tmp_path / name
        with forked_cli_launches():  # what is compared is the losses, not how workers start
            assert main(["train", *TINY, "--data", data, *flags, "--out", str(out)]) == 0
        losses[name] = _losses(out)
        assert len(losses[name]) == 3, name
    assert json.loads((tmp_path / "tp2+sp" / "config.json").read_text())["sequence_parallel"] is True
    for name in ("tp2", "tp2+sp"):
        np.testing.assert_allclose(losses[name], losses["tp1"], rtol=1e-5, err_msg=name)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipewright: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tp", "2", "--sequence-parallel", "--scatter-gather"], "drop one of"),
        (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
        (["--scatter-gather"], "--scatter-gather needs tensor parallelism"),
        (["--tp", "2", "--sequence-parallel", "--seq-len", "15"], "--seq-len 15 is not divisible"),
    ],
)
def test_incompatible_flags_are_one_line(capsys, data, flags, expected):
    assert expected in _error(capsys, ["train", *TINY, "--data", data, *flags])
