"""Resharding on resume, non-finite gradients and hang reports, through the real trainer in one launch
of 4 worker processes (one process group shared by every case):

* resharding: a run at pp = 2, dp = 2 checkpoints after step 3 and goes on to step 6; the checkpoint,
  resumed at pp = 4, at pp = 1, dp = 4 (torch.distributed.checkpoint loads each rank's parameters
  and optimizer state from the other layout's files) and at pp = 2, tp = 2 (shards cut from the full
  tensors, runtime/checkpointing/reshard.py), gives the same losses within 1e-5 relative;
* a NaN written into stage 1's gradient after step 2's backward (``PIPEWRIGHT_FAULTS``): with
  ``on_nonfinite="skip"`` every rank skips that optimizer step, the message names the step, the stage
  and the parameter, and every loss equals a run that skipped step 2's optimizer step; with "stop"
  every rank raises the same one-line error;
* a hang: pp rank 1 stalls at position 2 of step 1; the other ranks' receives time out and the error
  carries every rank's position (rank 1 at position 2) on the schedule grid.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from _queue_spawn import fork_launch
from pipewright.data.tokens import write_tokens
from pipewright.errors import PipewrightError
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import prepare

STEPS, SAVED = 6, 3
GLOBAL = 16  # sequences per step: microbatch_size 2 × microbatches × dp


def _config(tmp: Path, pp: int, dp: int, **kw) -> TrainConfig:
    base = TrainConfig(
        layers=4, hidden=32, heads=4, vocab=256, seq_len=16, microbatch_size=2, steps=STEPS, lr=0.05,
        warmup=2, grad_clip=0.5, optimizer="sgd", data=str(tmp / "tokens.bin"), progress=False,
        artifacts=False, eval_every=0, recv_timeout_s=120, out=str(tmp / "layouts"),
    )  # fmt: skip
    return replace(base, pp=pp, dp=dp, microbatches=GLOBAL // (2 * dp), **kw)


def _with_faults(faults: str, make):
    os.environ["PIPEWRIGHT_FAULTS"] = faults
    try:
        return make()
    finally:
        os.environ.pop("PIPEWRIGHT_FAULTS", None)


def _worker(rank: int, tmp: Path) -> dict:
    meshes: dict = {}

    def trainer(config: TrainConfig) -> Trainer:
        key = (config.dp, config.pp, config.tp)
        if key not in meshes:
            meshes[key] = ParallelMesh.build(dp=config.dp, pp=config.pp, tp=config.tp)
        return Trainer(prepare(config), mesh=meshes[key])

    out: dict = {}
    # resharding: save at pp=2, dp=2 after SAVED steps; resume at pp=4 and at pp=1, dp=4
    t = trainer(_config(tmp, 2, 2))
    out["straight"] = []
    for step in range(STEPS):
        out["straight"].append(t.train_step(step)["loss"])
        if step + 1 == SAVED:
            t.save(SAVED)
    for pp, dp, tp in ((4, 1, 1), (1, 4, 1), (2, 1, 2)):
        t = trainer(_config(tmp, pp, dp, resume=True, tp=tp))
        assert t.load(t.run.resume_from) == SAVED
        out[f"pp{pp}dp{dp}tp{tp}"] = [t.train_step(step)["loss"] for step in range(SAVED, STEPS)]

    # non-finite: NaN into stage 1's gradient at step 2; skip, against a run that skips step 2 (a folder
    # of their own: "layouts" holds the resharding run's checkpoints, which a new run may not overwrite)
    fresh = str(tmp / "nonfinite")
    t = _with_faults(
        "nan:stage=1:step=2", lambda: trainer(_config(tmp, 2, 2, on_nonfinite="skip", out=fresh))
    )
    records = [t.train_step(step) for step in range(5)]
    out["skip"] = (
        [r["loss"] for r in records],
        [r.get("skipped", False) for r in records],
        t.guard.last_nonfinite,
    )
    t = trainer(_config(tmp, 2, 2, out=fresh))
    ref = []
    for step in range(5):
        ref.append(t.forward_backward(step))
        if step != 2:
            t.optimizer_step(step)
    out["skip_reference"] = ref
    t = _with_faults("nan:stage=1:step=1", lambda: trainer(_config(tmp, 2, 2, out=fresh)))
    t.train_step(0)
    try:
        t.train_step(1)
        out["stop"] = None
    except PipewrightError as exc:
        out["stop"] = f"{type(exc).__name__}: {exc}"

    # hang: pp rank 1 stalls (5 s) at position 2 of step 1; receives time out after 1 s (last case: the
    # pipeline's channels are left with unmatched transfers)
    dist.barrier()
    faults = "pause:rank=1:step=1:pos=2:ms=5000"
    t = _with_faults(faults, lambda: trainer(_config(tmp, 4, 1, recv_timeout_s=1.0, out=str(tmp / "hang"))))
    t.train_step(0)
    try:
        t.train_step(1)
        out["hang"] = None
    except PipewrightError as exc:
        out["hang"] = (str(exc), getattr(exc, "report", ""))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("layouts")
    write_tokens(tmp / "tokens.bin", np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    return fork_launch(_worker, 4, (tmp,), timeout_s=600)


@pytest.mark.slow
def test_resume_at_other_layouts_continues_the_same_losses(results):
    straight = results[0]["straight"]
    for key in ("pp4dp1tp1", "pp1dp4tp1", "pp2dp1tp2"):
        for r in results:
            np.testing.assert_allclose(r[key], straight[SAVED:], rtol=1e-5, err_msg=key)


@pytest.mark.slow
def test_nan_gradient_is_reported_and_skipped_like_a_skipped_step(results):
    for r in results:
        losses, skipped, message = r["skip"]
        assert skipped == [False, False, True, False, False]
        assert message.startswith("step 2: non-finite values: nan gradient in stage 1, parameter ")
        assert "skipped the optimizer step" in message and "\n" not in message
        np.testing.assert_allclose(losses, r["skip_reference"], rtol=1e-6)
        assert np.isfinite(losses).all()
    stops = {r["stop"] for r in results}
    assert len(stops) == 1
    stop = stops.pop()
    assert stop.startswith("NonFiniteError: step 1: non-finite values: nan gradient in stage 1, parameter")
    assert "--on-nonfinite skip" in stop and "\n" not in stop


@pytest.mark.slow
def test_hang_reports_every_rank_position(results):
    reports = [r["hang"] for r in results]
    assert all(h is not None for h in reports)
    message, report = next(h for h in reports if "hang-report.txt" in h[0])
    assert message.startswith("hang: rank ") and "received nothing" in message and "\n" not in message
    lines = report.splitlines()
    assert lines[1].startswith("rank 1 (pp 1): step 1, position 2 ")
    for r in (0, 2, 3):
        assert lines[r].startswith(f"rank {r} (pp {r}): step 1, position ")
    grid = lines[4:]
    assert grid[0].startswith("position")
    assert all(row.count("[") == 1 for row in grid[1:5])  # each rank's current cell marked
    written = Path(message.split(" in ")[-1]).read_text()
    assert report in written
