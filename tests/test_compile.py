"""``--compile``: torch.compile per stage under 1F1B and ZB-H1 (split backward: the weight gradients
still wait for W) equals the uncompiled run and the single-process reference within 1e-5 (fp32).

The multi-process case traces with the ``aot_eager`` backend (``PIPEWRIGHT_COMPILE_BACKEND``): dynamo
and AOTAutograd — the compiled forward and the backward derived from it — without inductor's code
generation, whose compile time on CPU is a benchmark's business (benchmarks/bench_compile.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _queue_spawn import fork_launch
from pipewright.runtime.core.compile import BACKEND_ENV, CompiledForward, compile_stages
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from test_layer_list import _base, _pipe, _reference

RTOL = 1e-5


def _worker(rank: int, runs: list[PreparedRun]) -> list | None:
    results, mesh = [], ParallelMesh.build(dp=1, pp=2, tp=1)
    for run in runs:
        trainer = Trainer(run, mesh=mesh)
        losses, grads = [], {}
        for step in range(run.config.steps):
            losses.append(trainer.forward_backward(step))
            if step == 0:
                grads = {n: p.grad.clone() for n, p in trainer.params.items()}
            trainer.optimizer_step(step)
        deferred = sum(len(trainer.executor.deferrable[s]) for s in trainer.stages)
        compiled = [
            (f.compiled is not None, f.failed)
            for f in (m.forward for m in trainer.stages.values())
            if isinstance(f, CompiledForward)
        ]
        params = {n: p.detach().clone() for n, p in trainer.params.items()}
        gathered = [None] * 2 if rank == 0 else None
        dist.gather_object((losses, grads, params, deferred, compiled), gathered, dst=0)
        results.append(gathered)
    return results if rank == 0 else None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).norm()) <= RTOL * float(want.norm()) + 1e-12


@pytest.mark.slow
def test_compiled_stages_equal_uncompiled_under_1f1b_and_zb_h1(tmp_path, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    base = replace(_base(), pp=2, microbatches=4, out=str(tmp_path / "run"))
    cases = [replace(base, schedule=s, compile=on) for s in ("1f1b", "zb-h1") for on in (False, True)]
    runs = [_pipe().prepare(c) for c in cases]
    ref = _reference(runs[0].model, runs[0].config)
    want_losses, want_grads, want_params = ref.losses, ref.grads0, ref.params
    by_case = {}
    for run, gathered in zip(runs, fork_launch(_worker, 2, (runs,), timeout_s=600)[0], strict=True):
        c = run.config
        for losses, grads, params, deferred, compiled in gathered:
            if c.compile:  # every stage went through the compiler, none fell back
                assert compiled == [(True, None)], (c.schedule, compiled)
            else:
                assert compiled == []
            assert (deferred > 0) == (c.schedule == "zb-h1")  # I/W: DeferrableLinear layers
            assert list(grads) and torch.allclose(
                torch.tensor(losses), torch.tensor(want_losses[:3]), rtol=RTOL
            )
            for name, g in grads.items():
                assert _close(g, want_grads[name]), (c.schedule, c.compile, name)
                assert _close(params[name], want_params[name]), (c.schedule, c.compile, name)
            by_case.setdefault((c.schedule, c.compile), []).append((losses, grads, params))
    for schedule in ("1f1b", "zb-h1"):  # compiled vs uncompiled, rank by rank
        for (l0, g0, p0), (l1, g1, p1) in zip(by_case[schedule, False], by_case[schedule, True], strict=True):
            assert torch.allclose(torch.tensor(l1), torch.tensor(l0), rtol=RTOL)
            assert all(_close(g1[n], g0[n]) and _close(p1[n], p0[n]) for n in g0)


def test_a_stage_that_cannot_compile_runs_eagerly_with_one_line(caplog):
    stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    eager = stage(torch.ones(2, 4))
    wrappers = compile_stages({3: stage}, backend="no-such-backend")
    with caplog.at_level(logging.WARNING):
        got = stage(torch.ones(2, 4))
        stage(torch.ones(2, 4))  # no second warning: the stage stays eager
    assert torch.equal(got, eager)
    assert wrappers[3].failed is not None and "\n" not in wrappers[3].failed
    lines = [r.getMessage() for r in caplog.records if "--compile" in r.getMessage()]
    assert (
        len(lines) == 1 and lines[0].startswith("--compile: stage 3 runs eagerly (") and "\n" not in lines[0]
    )
