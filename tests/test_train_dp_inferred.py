"""Data parallelism from the process count, as Megatron-LM and torchtitan take it from the world size:
``train --nproc 4 --pp 2`` is prepared with dp 2 (and so under torchrun with WORLD_SIZE 8, tp 2, pp 2);
a process count that tp × cp × pp does not divide, or a ``--dp`` that disagrees with it, is a one-line
error. (``--dry-run`` runs every check ``train`` runs before it starts the workers; a four-process run
takes 40–80 s on a two-core machine, too long for the suite.)"""

from __future__ import annotations

from pipewright.cli import main

TINY = ["--model", "gpt-tiny", "--layers", "2", "--seq-len", "16", "--microbatches", "2", "--steps", "1"]
TINY += ["--no-progress", "--no-artifacts", "--eval-every", "0"]


def _last_err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_dp_from_nproc_and_torchrun(capsys, tmp_path, monkeypatch) -> None:
    out = ["--out", str(tmp_path / "run")]
    assert main(["train", *TINY, *out, "--nproc", "4", "--pp", "2", "--dry-run"]) == 0
    assert "over tp=1 pp=2 dp=2" in capsys.readouterr().out
    assert main(["train", *TINY, *out, "--nproc", "3", "--pp", "2", "--dry-run"]) == 2
    assert _last_err(capsys) == (
        "pipewright: error: --nproc 3 is not a multiple of tp × cp × pp = 1×1×2 = 2; start a multiple of 2 "
        "processes or give --dp"
    )
    assert main(["train", *TINY, *out, "--nproc", "4", "--pp", "2", "--dp", "1", "--dry-run"]) == 2
    assert "--nproc 4 but tp × cp × pp × dp = 1×1×2×1 = 2" in _last_err(capsys)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["train", *TINY, *out, "--pp", "2", "--tp", "2", "--dry-run"]) == 0
    assert "over tp=2 pp=2 dp=2" in capsys.readouterr().out
