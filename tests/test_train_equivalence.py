"""Pipelined training through the real trainer equals single-process training.

Pipeline × data parallelism: every synchronous schedule in the registry, layouts (pp, dp) ∈ {(4, 1),
(2, 2), (4, 2)}, v ∈ {1, 2} where the schedule takes it (pp = 2, dp = 1 is covered against other
layouts by test_train_cli.py, to save a launch): the loss and every parameter's gradient after one
iteration, every parameter after 3 optimizer steps and the validation loss then (a forward-only pass)
(SGD with momentum, warm-up, global-norm clipping active) match a single-process reference on the same
data within 1e-5 relative (fp32). Three steps suffice: every synchronous schedule flushes within a
step, so what later steps add is the state carried between them — the momentum buffer (the third step
applies two earlier gradients through it), the learning rate by step (two warm-up values, then the
peak) and the clipping of each step's global norm — all present by the third step.

PTD-P (:data:`PTDP_LAYOUTS`, :func:`_ptdp_cases`): tensor parallelism t = 2 in every one of those
schedules and v, in (pp, dp) ∈ {(2, 1), (2, 2), (4, 1)} (t·p·d = 2·4·2 = 16 exceeds the 8-process
limit), each as plain TP (vocabulary-parallel embedding and loss, column/row-parallel linears), TP +
sequence parallelism, and TP + scatter/gather of the stage boundaries: the loss and every gradient
(shards gathered to full size) after one iteration, the parameters after that step and the validation
loss then, against the same reference and tolerance. The three modes are spread over the layouts (see
:func:`_ptdp_cases`) so that every schedule/v runs in every mode and every layout in every mode;
``PIPEWRIGHT_FULL_PTDP=1`` runs the full product.

One launch per world size (4, 8 processes, forked from the test process) runs all its cases.

(AdamW is not used for the 3-step comparison: it divides by √v, so parameters whose gradient is
rounding noise — the key bias, to which softmax is invariant — move by ±lr on either side.)
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from _queue_spawn import fork_launch
from _single_process import Reference, compare, single_process, train_and_gather
from pipewright.data.tokens import write_tokens
from pipewright.errors import PipewrightError
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import schedule_names
from pipewright.schedules.registry import check_args, info
from pipewright.training import prepare

STEPS = 3  # see the module docstring
RTOL = 1e-5
PTDP_LAYOUTS = ((2, 1), (2, 2), (4, 1))  # (pp, dp) with t = 2
FULL_PTDP = os.environ.get("PIPEWRIGHT_FULL_PTDP") == "1"  # every mode × layout × schedule (~3× longer)
PTDP_MODES = {
    "tp": {},
    "tp+sp": {"sequence_parallel": True},
    "tp+scatter-gather": {"scatter_gather": True},
}


def _schedules(layouts) -> list[tuple[str, int, int, int, int]]:
    """(name, pp, dp, v, m) for every synchronous schedule, layout and v ∈ {1, 2} it takes; m is the
    least of 4, 8 it accepts."""
    out = []
    for name in schedule_names(distinct_orders=True):
        entry = info(name)
        if not entry.synchronous:
            continue
        for pp, dp in layouts:
            for v in (1, 2):
                if entry.chunks is not None and v not in entry.chunks:
                    continue
                m = next((m for m in (4, 8) if _accepts(name, pp, m, v)), None)
                if m is not None:
                    out.append((name, pp, dp, v, m))
    return out


def _base(data: str) -> TrainConfig:
    return TrainConfig(
        layers=8, hidden=32, heads=4, vocab=256, seq_len=16, microbatch_size=1, steps=STEPS, lr=0.05,
        warmup=2, grad_clip=0.5, optimizer="sgd", data=data, progress=False, artifacts=False, eval_every=0,
        recv_timeout_s=120,
    )  # fmt: skip


def _cases(data: str) -> list[TrainConfig]:
    base = _base(data)
    cases = [
        replace(base, schedule=name, pp=pp, dp=dp, virtual=v, microbatches=m)
        for name, pp, dp, v, m in _schedules(((4, 1), (2, 2), (4, 2)))  # (2, 1): test_train_cli.py
    ]
    return cases + [config for _, config in _ptdp_cases(data)]


def _ptdp_cases(data: str, full: bool = FULL_PTDP) -> list[tuple[str, TrainConfig]]:
    """(mode, config) for t = 2: the i-th (schedule, v) runs in mode (i + j) mod 3 in the j-th layout,
    so each schedule/v meets each mode once over the three layouts (and each layout runs every mode):
    a Latin square instead of the full 3 × 3 product, to keep the test short; ``full`` (environment
    ``PIPEWRIGHT_FULL_PTDP=1``) runs every mode in every layout. One optimizer step each, pp·v layers
    (one per stage)."""
    base = replace(_base(data), tp=2, steps=1, warmup=0)
    modes = list(PTDP_MODES)
    order = list(dict.fromkeys((name, v) for name, _, _, v, _ in _schedules(PTDP_LAYOUTS)))
    cases = []
    for j, layout in enumerate(PTDP_LAYOUTS):
        for name, pp, dp, v, m in _schedules((layout,)):
            # one transformer layer per stage: halves the per-layer tp collectives of 8 layers
            config = replace(base, schedule=name, pp=pp, dp=dp, virtual=v, microbatches=m, layers=pp * v)
            chosen = modes if full else [modes[(order.index((name, v)) + j) % len(modes)]]
            cases += [(mode, replace(config, **PTDP_MODES[mode])) for mode in chosen]
    return cases


def _accepts(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_args(name, p, m, v)
    except PipewrightError:
        return False
    return True


def _facts(trainer: Trainer) -> tuple[int, bool]:
    """What the mode changed: the boundary tensor's length and whether boundaries travel in 1/t pieces."""
    return trainer.boundary_shape[1], trainer.executor.comm.scatter_gather


@pytest.mark.slow
def test_pipelined_training_equals_single_process(tmp_path):
    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    by_world: dict[int, list[PreparedRun]] = defaultdict(list)
    for config in _cases(str(data)):
        by_world[config.world_size].append(prepare(replace(config, out=str(tmp_path / "run"))))
    assert sum(map(len, by_world.values())) >= 16 and set(by_world) == {4, 8}
    references: dict[tuple[int, int, int], Reference] = {}
    failures = []
    for world, runs in sorted(by_world.items()):
        for run, gathered in zip(
            runs, fork_launch(train_and_gather, world, (runs, _facts), timeout_s=600)[0], strict=True
        ):
            c = run.config
            v = run.schedule.num_stages // c.pp
            mode = "+sp" if c.sequence_parallel else "+scatter-gather" if c.scatter_gather else ""
            label = f"{c.schedule} pp={c.pp} dp={c.dp} tp={c.tp}{mode} v={v} m={c.microbatches}"
            key = (c.global_batch, c.steps, c.layers)
            if key not in references:
                references[key] = single_process(run.config, run.spec)
            want_facts = (run.spec.seq_len // (c.tp if c.sequence_parallel else 1), c.scatter_gather)
            assert all(seen.facts == want_facts for seen in gathered), label
            bad, seen = compare(label, gathered, references[key], RTOL)
            failures += bad
            # every parameter is held by exactly one pipeline rank of each replica (tp ranks: shards)
            assert seen == dict.fromkeys(references[key].grads0, c.dp * c.tp), label
    assert not failures, "\n".join(failures[:20])


def test_ptdp_cases_cover_every_schedule_layout_and_mode(tmp_path):
    """The spread of :func:`_ptdp_cases`: every synchronous schedule and v it takes, in each of the three
    modes; every layout in each mode; tp = 2 throughout and at most 8 processes."""
    cases = _ptdp_cases(str(tmp_path / "tokens.bin"), full=False)
    assert len(cases) < len(_ptdp_cases(str(tmp_path / "tokens.bin"), full=True))
    mode_of = {id(config): mode for mode, config in cases}
    configs = [config for _, config in cases]
    assert all(c.tp == 2 and c.world_size <= 8 for c in configs)
    pairs = {(name, v) for name, _, _, v, _ in _schedules(PTDP_LAYOUTS)}
    assert {(c.schedule, c.virtual, mode_of[id(c)]) for c in configs} == {
        (name, v, mode) for name, v in pairs for mode in PTDP_MODES
    }
    assert {((c.pp, c.dp), mode_of[id(c)]) for c in configs} == {
        (layout, mode) for layout in PTDP_LAYOUTS for mode in PTDP_MODES
    }
