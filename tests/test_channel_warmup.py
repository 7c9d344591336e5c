"""Channel warm-up under NCCL's lazy point-to-point connection (``nccl_rules.set_lazy_connect``): the
first send or receive between two ranks on a group blocks until the peer's first. 1F1B at pp 2 with
every receive posted at step start then deadlocks unless the channels were opened by point-to-point
in one global order (``ParallelMesh.open_channels``) — an all-reduce warm-up opens no such
connection. Here the step completes and its gradients equal the one-process reference."""

from __future__ import annotations

import pytest

from _queue_spawn import fork_launch
from pipewright.runtime import ParallelMesh
from pipewright.runtime.setup import nccl_rules as rules
from pipewright.schedules import build_schedule
from test_executor import _executor, make_batch, make_stages, reference, rel_err


def _worker(rank: int) -> dict:
    rules.set_lazy_connect(3.0)
    mesh = ParallelMesh.build(1, 2, 1)
    stages = make_stages(2, 11)
    tokens, targets = make_batch(1, 4, 11)
    _, _, ref_grads = reference(stages, tokens, targets)
    ex = _executor(build_schedule("1f1b", 2, 4), mesh, stages, recv_window=None, recv_timeout_s=10)
    try:
        ex.run(tokens[0], targets[0])
    except Exception as e:  # the deadlock, as the rules report it
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    st = stages[mesh.pp_rank]
    return {
        "error": "",
        "grad_err": max(rel_err(p.grad, ref_grads[mesh.pp_rank][n]) for n, p in st.named_parameters()),
    }


@pytest.mark.slow
def test_first_step_after_point_to_point_warm_up_completes_under_lazy_connection() -> None:
    for rank, r in enumerate(fork_launch(_worker, 2, timeout_s=120)):
        assert r["error"] == "", (rank, r["error"])
        assert r["grad_err"] < 1e-5, rank
