"""K-FAC in the bubbles with data parallelism: replicas install each refresh at the same step.

Each dp replica runs its K-FAC tasks in its own measured bubbles, so replicas finish a refresh's
inversions at different steps. Installing the inverses when the local work is done let the replicas
drift apart; the next refresh's factor all-reduce then waited forever (a 4-process dp = 2 × pp = 2 run
timed out at 600 s). Now a replica installs a refresh at the first step where every replica has it.
This run (4 gloo processes, several refreshes) must finish, and both replicas must end with
bit-identical weights.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from _kfac_config import tiny_config
from _queue_spawn import fork_launch
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.training import prepare

STEPS = 12


def _worker(rank: int, run) -> dict:
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=2, pp=2, tp=1)
    tr = Trainer(run, mesh=mesh)
    losses = []
    for step in range(STEPS):
        losses.append(tr.forward_backward(step))
        tr.optimizer_step(step)
    flat = torch.cat([p.detach().reshape(-1) for st in tr.stages.values() for p in st.parameters()])
    other = [torch.empty_like(flat) for _ in range(mesh.dp)]
    dist.all_gather(other, flat, group=mesh.dp_group)
    return {
        "replicas_equal": all(torch.equal(other[0], o) for o in other),
        "refreshes": tr.optimizer.worker.refreshes,
        "losses": losses,
    }


@pytest.mark.slow
def test_dp_replicas_install_refreshes_together(tmp_path_factory):
    run = prepare(replace(tiny_config(tmp_path_factory, STEPS), dp=2, optimizer="kfac"), world_size=4)
    results = fork_launch(_worker, 4, (run,), timeout_s=240)
    for r in results:
        assert r["replicas_equal"]
        assert r["refreshes"] >= 1
        assert all(torch.isfinite(torch.tensor(r["losses"])))
