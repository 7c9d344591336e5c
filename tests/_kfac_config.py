"""The tiny training config the K-FAC runtime tests share (pp = 2, 1F1B, a token file of repeated text)."""

from __future__ import annotations

import numpy as np

from pipewright.data.tokens import write_tokens
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import replaced


def tiny_config(tmp_path_factory, steps: int, **overrides) -> TrainConfig:
    """4 layers, hidden 32, seq 16, m = 4 × b = 2, on a token file written under ``tmp_path_factory``;
    ``overrides`` by field name or feature option (``kfac_fill="all"``)."""
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 400, dtype=np.uint8)
    write_tokens(path, text.astype(np.int64), vocab_size=256)
    return replaced(
        TrainConfig(),
        layers=4, hidden=32, heads=4, vocab=256, seq_len=16, microbatch_size=2, microbatches=4,
        steps=steps, lr=0.01, warmup=2, data=str(path), progress=False, artifacts=False, eval_every=0,
        recv_timeout_s=120, seed=3, pp=2, schedule="1f1b", **overrides,
    )  # fmt: skip
