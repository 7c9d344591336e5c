"""Context parallelism through the real trainer equals single-process training.

A dense GPT at pp = 2 × cp = 2 (four processes) over 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV; a
Llama (grouped-query attention, rotary positions) at pp = 2 × cp = 2 over DualPipeV and at
tp = 2 × cp = 2 with sequence parallelism (pp = 1); a GPT at dp = 2 × cp = 2, its gradients
averaged over the four replicas in one all-reduce (no second one over cp): the loss of every step
and the validation loss after the last, every gradient after the first step and every parameter
after 3 steps (SGD with momentum, warm-up, global-norm clipping) equal a single-process reference
on the same data within 1e-5 relative (fp32, gloo); the same with ZeRO-1, its optimizer sharded over
the four dp × cp ranks (one reduce-scatter, no cp all-reduce). DualPipeV's F&B pairs run overlapped
(runtime/parallel/cp/overlap.py). The ring waits every exchange behind a block computation except the
backward's last (runtime/parallel/cp/ring.py). All cases run in one launch of four processes, sharing one
mesh per shape.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch.distributed as dist

from _queue_spawn import fork_launch
from _single_process import Reference, compare, single_process, train_and_gather
from pipewright.data.tokens import write_tokens
from pipewright.errors import ConfigError, PipewrightError
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules.registry import check_args
from pipewright.training import prepare

STEPS = 3
RTOL = 1e-5
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("dualpipev", 2))


def _base(data: str, model: str) -> TrainConfig:
    return TrainConfig(
        model=model, layers=4, hidden=16, heads=4, kv_heads=2 if model == "llama" else None, vocab=64,
        seq_len=16, microbatch_size=1, steps=STEPS, lr=0.05, warmup=1, grad_clip=0.5, optimizer="sgd",
        data=data, progress=False, artifacts=False, eval_every=0, eval_batches=1, recv_timeout_s=120,
        cp=2, pp=2,
    )  # fmt: skip


def _microbatches(name: str, pp: int, v: int) -> int:
    for m in (4, 8):
        try:
            check_args(name, pp, m, v)
            return m
        except PipewrightError:
            continue
    raise AssertionError(name)


def _cases(data: str) -> list[TrainConfig]:
    cases = [
        replace(_base(data, model), schedule=name, virtual=v, microbatches=_microbatches(name, 2, v))
        for model, name, v in [*(("gpt", *s) for s in SCHEDULES), ("llama", *SCHEDULES[-1])]
    ]
    tp = replace(_base(data, "llama"), pp=1, tp=2, sequence_parallel=True, schedule="1f1b", microbatches=2)
    dp = replace(_base(data, "gpt"), pp=1, dp=2, schedule="1f1b", microbatches=2)  # dp × cp reduced at once
    # ZeRO-1 sharded over the dp × cp ranks: one reduce-scatter for both, no cp all-reduce
    return [*cases, tp, dp, replace(dp, shard_optimizer=True)]


def _facts(trainer: Trainer) -> tuple[int, int, tuple[int, ...], int, int]:
    """The boundary tensor's sequence length, how many F&B pairs ran overlapped, the ring's
    exchanges and those waited with no block computed behind them (forward, backward), the
    gradient all-reduces over cp alone and the ranks ZeRO-1 shards over (0 unsharded)."""
    pairs = trainer.context.pair_overlap
    ring = trainer.context.ring
    counts = (ring.exchanges[False], ring.exposed[False], ring.exchanges[True], ring.exposed[True])
    overlapped = pairs.pairs_overlapped if pairs is not None else 0
    master = trainer.master
    shards = dist.get_world_size(master.dp_group) if master is not None and master.shard else 0
    return trainer.boundary_shape[1], overlapped, counts, trainer.context.grad_syncs, shards


@pytest.mark.slow
def test_context_parallel_training_equals_single_process(tmp_path):
    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 64, 5_000), vocab_size=64)
    runs = [prepare(replace(c, out=str(tmp_path / "run"))) for c in _cases(str(data))]
    assert {r.config.world_size for r in runs} == {4}
    references: dict[tuple, Reference] = {}
    failures = []
    for run, gathered in zip(
        runs, fork_launch(train_and_gather, 4, (runs, _facts), timeout_s=600)[0], strict=True
    ):
        c = run.config
        label = f"{c.model} {c.schedule} pp={c.pp} tp={c.tp} cp={c.cp} dp={c.dp} zero={c.shard_optimizer}"
        key = (c.model, c.global_batch)
        if key not in references:
            references[key] = single_process(c, run.spec)
        for seq, overlapped, (sent_f, exposed_f, sent_b, exposed_b), syncs, shards in (
            s.facts for s in gathered
        ):
            assert shards == (c.dp * c.cp if c.shard_optimizer else 0), label
            # with dp > 1 the dp all-reduce averages over dp × cp too: no second one over cp
            assert (syncs == 0) == (c.dp > 1), label
            assert seq == c.seq_len // c.cp // (c.tp if c.sequence_parallel else 1), label
            # DualPipeV's F&B pairs ran overlapped (forward on a second thread), every step
            assert (overlapped > 0) == (c.schedule == "dualpipev" and c.tp == 1), label
            # every ring exchange was waited behind a block computation but the backward's last
            # (its accumulator coming home): 2·(cp − 1) backward exchanges per exposed one
            assert sent_f > 0 and exposed_f == 0, label
            assert exposed_b > 0 and sent_b == 2 * (c.cp - 1) * exposed_b, label
        bad, seen = compare(label, gathered, references[key], RTOL)
        failures += bad
        # every parameter on one pipeline rank of each (cp, tp) slice
        assert seen == dict.fromkeys(references[key].grads0, c.dp * c.cp * c.tp), label
    assert not failures, "\n".join(failures[:20])


def test_cp_that_does_not_split_the_sequence_is_one_line_error(tmp_path):
    config = replace(_base(str(tmp_path / "none.bin"), "gpt"), data=None, seq_len=12, cp=4)
    with pytest.raises(ConfigError) as err:
        config.model_spec(64)
    assert "\n" not in str(err.value) and "--cp 4" in str(err.value)
