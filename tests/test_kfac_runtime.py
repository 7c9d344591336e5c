"""``--optimizer kfac`` in the runtime: K-FAC tasks run by registered handlers in the bubbles.

One 2-process gloo launch runs the same tiny model and data three times (pp = 2, 1F1B): AdamW, K-FAC
in the predicted bubbles, and K-FAC with the opportunistic receive mode as well. The forward/backward
work is the same (the step-0 loss is equal to the bit; the refresh's inverses only change the update
once installed), a refresh completes within the run, and the preconditioned steps then differ. A
single-process case checks that the bubble worker's piecewise inversions equal the serial refresh.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _kfac_config import tiny_config
from _queue_spawn import fork_launch
from pipewright.features.kfac.kfac import KFAC, KFACConfig
from pipewright.features.kfac.kinds import KFAC_FILL, KFAC_PRECOND
from pipewright.features.kfac.runtime import BubbleWorker, slot_schedule
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.schedules.registry import build_schedule
from pipewright.training import check_config, config_from_values, prepare, replaced

STEPS = 6


def _worker(rank: int, runs, opportunistic: list[bool]) -> list:
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, pp=2, tp=1)
    out = []
    for run, opp in zip(runs, opportunistic, strict=True):
        tr = Trainer(run, mesh=mesh)  # --kfac-opportunistic puts the waiting receive handlers in
        assert run.config.features["kfac"].opportunistic == opp
        losses = []
        for step in range(STEPS):
            losses.append(tr.forward_backward(step))
            tr.optimizer_step(step)
        kinds = sorted({a.kind for a in tr.executor.actions})
        facts = None
        if run.config.optimizer == "kfac":
            w = tr.optimizer.worker
            facts = (w.refreshes, w.tasks_run)
        facts = (*facts, tr.optimizer.worker.waits_filled) if facts else None
        out.append((losses, kinds, facts))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tiny_config(tmp_path_factory, STEPS)
    configs = [
        base,
        replace(base, optimizer="kfac"),
        replaced(base, optimizer="kfac", kfac_opportunistic=True),
    ]
    runs = [prepare(c, world_size=2) for c in configs]
    return fork_launch(_worker, 2, (runs, [False, False, True]), timeout_s=300)


@pytest.mark.slow
def test_kfac_runs_the_same_forward_backward_and_refreshes(results):
    (adamw, _, _), (kfac, kinds, facts), (opp, _, opp_facts) = results[1]
    assert kfac[0] == adamw[0] and opp[0] == adamw[0]  # the same F/B work at step 1
    assert KFAC_FILL in kinds and KFAC_PRECOND in kinds
    refreshes, tasks, waits_filled = facts
    assert refreshes >= 1 and tasks > 0 and waits_filled == 0
    assert opp_facts[0] >= 1 and opp_facts[2] > 0  # --kfac-opportunistic: waiting receives ran K-FAC tasks
    assert kfac[-1] != adamw[-1]  # the preconditioned update is in use
    assert all(np.isfinite(kfac)) and kfac[-1] < kfac[0]


def test_bubble_worker_pieces_equal_serial_refresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 300), nn.GELU(), nn.Linear(300, 5)).double()
    xs = [torch.randn(2, 3, 6, dtype=torch.float64) for _ in range(2)]

    def record(kfac: KFAC) -> None:
        for k, x in enumerate(xs):
            kfac.microbatch = k
            model(x).pow(2).sum().backward()
        kfac.microbatch = None

    serial = KFAC([("0", model[0]), ("2", model[2])], KFACConfig())
    record(serial)
    serial.refresh()
    serial.remove_hooks()
    worker = BubbleWorker(KFAC([("0", model[0]), ("2", model[2])], KFACConfig()), [0, 0], microbatches=2)
    record(worker.kfac)
    worker.begin_iteration(0)
    worker.begin_iteration(1)  # recording ends with the iteration
    worker._recorded = False
    worker.recording = False
    while worker.run_one(None):
        pass
    assert worker.refreshes == 1 and worker.tasks_run > 4 + 2 + 2  # curvature, reductions, pieces
    for a, b in zip(worker.kfac.layers, serial.layers, strict=True):
        torch.testing.assert_close(a.a_inv, b.a_inv, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.b_inv, b.b_inv, rtol=1e-9, atol=1e-9)


def test_slot_schedule_puts_a_fill_in_every_predicted_bubble():
    sched, budgets = slot_schedule(build_schedule("1f1b", 4, 8))
    fills = [a for row in sched.actions for a in row if a.kind == KFAC_FILL]
    assert len(fills) == len(budgets) and all(v > 0 for v in budgets.values())
    # 1F1B, p = 4, unit costs: rank r idles r units before its first F; the last rank never waits there
    assert budgets.get((0, 0)) is None or sched.actions[0][0].kind != KFAC_FILL
    assert budgets[(3, 0)] == pytest.approx(3.0)


def test_opportunistic_mode_needs_kfac():
    from pipewright.errors import ConfigError

    with pytest.raises(ConfigError, match="--kfac-opportunistic needs --optimizer kfac"):
        check_config(config_from_values({"kfac_opportunistic": True}))
