"""The ``spawn`` hook of local runs (``pipewright.training.workers``): a run started with ``spawn=``, or
inside ``launching_with(spawn)``, starts its tp × cp × pp × dp workers through that function — the given
one before the block's, the block's before fresh processes — and no worker starts here (the hook records
the call and returns rank 0's result)."""

from __future__ import annotations

import numpy as np

from pipewright.data.tokens import write_tokens
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import spawn as spawn_processes
from pipewright.training.workers import launcher, launching_with, train, train_worker


class _Recorder:
    """A ``spawn`` that records what it was asked to start and returns ``result`` as rank 0's."""

    def __init__(self, result: str) -> None:
        self.result, self.calls = result, []

    def __call__(self, fn, nprocs, args=(), **options) -> list:
        self.calls.append((fn, nprocs, options))
        return [self.result] + [None] * (nprocs - 1)


def test_the_spawn_given_then_the_blocks_then_fresh_processes(tmp_path):
    write_tokens(tmp_path / "tokens.bin", np.arange(500) % 64, vocab_size=64)
    config = TrainConfig(
        layers=4, hidden=16, heads=4, vocab=64, seq_len=16, microbatch_size=1, microbatches=4, pp=2, cp=2,
        steps=2, warmup=1, data=str(tmp_path / "tokens.bin"), progress=False, artifacts=False, eval_every=0,
    )  # fmt: skip
    given, block = _Recorder("given"), _Recorder("block")
    assert launcher() is spawn_processes
    with launching_with(block):
        assert launcher() is block and launcher(given) is given
        assert train(config.with_overrides(out=str(tmp_path / "a"))) == "block"
        assert train(config.with_overrides(out=str(tmp_path / "b")), spawn=given) == "given"
    assert launcher() is spawn_processes
    for recorder in (given, block):
        ((fn, nprocs, options),) = recorder.calls
        assert fn is train_worker and nprocs == 2 * 2 and options["forward_sigterm"] is True
