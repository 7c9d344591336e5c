"""``pipewright check`` for the layouts ``train`` runs beyond pp/dp/tp.

The one-process reference of any layout (cp, ep, tp, dp, vocabulary-parallel) has one process and the
same global batch, with the layout's features kept (their losses equal the run without them). One real
check (forked workers): ``--vocab-parallel alg1`` at pp = 2 equals one process at every step. A layout
whose one-process run is another algorithm — K-FAC with measured fill, an asynchronous schedule — is
refused in one line before any worker starts. (cp = 2, ep = 2, K-FAC with ``--kfac-fill all`` equal one
process as well; measured at 50–70 s per check on this machine, they are not repeated here.)
"""

from __future__ import annotations

from pathlib import Path

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.cli.check import reference_config
from pipewright.training import config_from_values

MODEL = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8"]
MODEL += ["--steps", "2"]
BATCH = ["--microbatches", "2", "--microbatch-size", "1"]


def test_reference_is_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    config = config_from_values(dict(
        model="gpt", layers=4, hidden=16, heads=2, seq_len=16, pp=2, dp=4, tp=2, cp=2, ep=2,
        moe_experts=4, microbatches=3, microbatch_size=2, vocab_parallel="alg1",
    ))  # fmt: skip
    one = reference_config(config, tmp_path)
    assert (one.pp, one.dp, one.tp, one.cp, one.ep, one.world_size) == (1, 1, 1, 1, 1, 1)
    assert one.global_batch == config.global_batch == 24 and one.microbatches == 12
    assert one.seq_len == config.seq_len and one.features == config.features


def test_vocab_parallel_equals_one_process(capsys) -> None:
    with forked_cli_launches():
        assert main(["check", *MODEL, "--pp", "2", "--vocab-parallel", "alg1", *BATCH]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "equal: 2 steps within 0.0001 (fp32) of one process"


def test_layouts_unlike_one_process_are_refused_in_one_line(capsys) -> None:
    assert main(["check", *MODEL, "--pp", "2", "--optimizer", "kfac", *BATCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("pipewright: error: check --optimizer kfac needs --kfac-fill all")
    assert main(["check", *MODEL, "--pp", "2", "--schedule", "async-1f1b", *BATCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "asynchronous schedule async-1f1b" in err[0]
