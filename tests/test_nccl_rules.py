"""NCCL's rules over gloo (:mod:`pipewright.runtime.setup.nccl_rules`) and the executor's point-to-point under
them: each receive completes on its own, no synchronize inside the step, boundary buffers bounded.

One launch of two ranks runs every case; the workers return plain values and the tests assert on them.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _queue_spawn import fork_launch
from pipewright.runtime import ParallelMesh, spawn
from pipewright.runtime.core.distributed_errors import CollectiveTimeout
from pipewright.runtime.setup import nccl_rules as rules
from pipewright.schedules import build_schedule
from test_executor import RTOL, _executor, make_batch, make_stages, reference, rel_err


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _rule_checks(rank: int) -> dict:
    """The mode's own rules, on dedicated groups (a mismatch leaves its group unusable)."""
    out: dict = {"active": rules.active()}
    # A batch completes as one Work: waiting it waits for every receive of the batch.
    if rank == 0:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((3,), float(i)), 1) for i in range(3)]
        )
        works[0].wait()
    else:
        bufs = [torch.empty(3) for _ in range(3)]
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0) for b in bufs])
        works[0].wait()
        out["batch_values"] = [b[0].item() for b in bufs]
    out["batch_works"] = len(works)
    # Issue order on one communicator: waiting the second receive waits the first.
    if rank == 0:
        dist.send(torch.ones(2), 1)
        dist.send(torch.ones(2), 1)
    else:
        first, second = dist.irecv(torch.empty(2), 0), dist.irecv(torch.empty(2), 0)
        second.wait()
        out["in_order"] = first.is_completed()
    # Point-to-point mismatch (same bytes, other count and type): named on the receiving rank.
    g = dist.new_group([0, 1])
    if rank == 0:
        dist.isend(torch.ones(2, dtype=torch.float64), 1, group=g)
    else:
        out["p2p_mismatch"] = _error(lambda: dist.recv(torch.empty(4), 0, group=g))
    # Collective mismatch (same bytes, other type): named on both ranks.
    g = dist.new_group([0, 1])
    dtype = torch.float32 if rank == 0 else torch.int32
    out["collective_mismatch"] = _error(lambda: dist.all_reduce(torch.zeros(4, dtype=dtype), group=g))
    # A tensor off the group's declared device.
    g = dist.new_group([0, 1])
    rules.declare_device(g, "cuda")
    out["wrong_device"] = _error(lambda: dist.all_reduce(torch.zeros(2), group=g))
    # Lazy connection: the first point-to-point operation between two ranks on a group blocks until
    # the peer's first; receives posted first on both channels of a pair block each other.
    rules.set_lazy_connect(1.0)
    g = dist.new_group([0, 1])
    start = time.perf_counter()
    if rank == 1:
        time.sleep(0.3)
        dist.send(torch.ones(1), 0, group=g)
    else:
        work = dist.irecv(torch.empty(1), 1, group=g)
        out["connect_s"] = time.perf_counter() - start
        work.wait()
    to_me = [dist.new_group([0, 1]), dist.new_group([0, 1])][rank]  # one channel per direction
    out["receives_first"] = _error(lambda: dist.irecv(torch.empty(1), 1 - rank, group=to_me))
    rules.set_lazy_connect(None)
    # A device-wide synchronize waits for a posted receive nobody sends: reported, not hung on (gloo
    # closes the pair on the timeout, so the group is not used again).
    g = dist.new_group([0, 1])
    if rank == 1:
        dist.irecv(torch.empty(1), 0, group=g)
    start = time.perf_counter()
    out["sync"] = _error(lambda: rules.synchronize(1.0))
    out["sync_s"] = time.perf_counter() - start
    dist.barrier()
    return out


def _pipeline_checks(rank: int) -> dict:
    """1F1B at pp 2 under the rules: all receives posted at step start (finding: one Work per peer's
    batch deadlocked), a recorded step's device synchronizes, and the boundary buffers held."""
    mesh = ParallelMesh.build(1, 2, 1)
    out: dict = {}
    m = 4
    stages = make_stages(2, 7)
    tokens, targets = make_batch(1, m, 7)
    _, _, ref_grads = reference(stages, tokens, targets)
    ex = _executor(build_schedule("1f1b", 2, m), mesh, stages, recv_depth=m, recv_timeout_s=5)
    out["all_posted"] = _error(lambda: ex.run(tokens[0], targets[0]))
    st = stages[mesh.pp_rank]
    out["grad_err"] = max(rel_err(p.grad, ref_grads[mesh.pp_rank][n]) for n, p in st.named_parameters())
    # Recorded steps: count the device synchronizes per step.
    ex = _executor(build_schedule("1f1b", 2, m), mesh, make_stages(2, 8), record=True, recv_timeout_s=5)
    calls = _count_calls(ex, "device_sync")
    per_step = []
    for _ in range(2):
        before = len(calls)
        ex.run(tokens[0], targets[0])
        per_step.append(len(calls) - before)
    out["syncs_per_step"], out["spans"] = per_step, len(ex.last_spans)
    # Boundary buffers (posted receives + unreleased sends) held after each action, m = 8.
    held: list[int] = []

    def watch(kind, handler):
        def run(state, a):
            handler(state, a)
            held.append(state.comm.held())

        return run

    tokens, targets = make_batch(1, 8, 9)
    ex = _executor(build_schedule("1f1b", 2, 8), mesh, make_stages(2, 9), handler_wrappers=[watch])
    ex.run(tokens[0], targets[0])
    out["held"] = max(held)

    # What the step did before: a synchronize after every action. Under the rules it waits for the
    # receives posted ahead, which need this rank's later sends: reported as a timeout (last: gloo
    # closes the channels' pairs on a timeout).
    def sync_after(kind, handler):
        def run(state, a):
            handler(state, a)
            state.executor.device_sync()

        return run

    ex = _executor(
        build_schedule("1f1b", 2, 4), mesh, make_stages(2, 0), recv_timeout_s=1, handler_wrappers=[sync_after]
    )
    tokens, targets = make_batch(1, 4, 0)
    out["sync_each_action"] = _error(lambda: ex.run(tokens[0], targets[0]))
    return out


def _worker(rank: int) -> dict:
    return {"rules": _rule_checks(rank), "pipeline": _pipeline_checks(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return fork_launch(_worker, 2, timeout_s=120)


@pytest.mark.slow
def test_multi_process_tests_run_under_nccl_rules(results) -> None:
    assert [r["rules"]["active"] for r in results] == [True, True]


@pytest.mark.slow
def test_a_batch_completes_as_one_work_and_one_group_in_issue_order(results) -> None:
    assert [r["rules"]["batch_works"] for r in results] == [1, 1]
    assert results[1]["rules"]["batch_values"] == [0.0, 1.0, 2.0]
    assert results[1]["rules"]["in_order"] is True


@pytest.mark.slow
def test_mismatched_operations_are_named_on_both_sides(results) -> None:
    assert results[1]["rules"]["p2p_mismatch"] == (
        "RulesMismatch: rank 1 posted recv #0 of 4 float32 (shape [4]) from rank 0, but rank 0's matching "
        "operation on that channel is send #0 of 2 float64 (shape [2])"
    )
    for rank, other, mine, theirs in ((0, 1, "float32", "int32"), (1, 0, "int32", "float32")):
        assert results[rank]["rules"]["collective_mismatch"] == (
            f"RulesMismatch: rank {rank} issued all_reduce #0 of 4 {mine} (shape [4]) but rank {other} "
            f"issued all_reduce #0 of 4 {theirs} (shape [4]) at that place on the same group"
        )


@pytest.mark.slow
def test_a_tensor_off_the_groups_device_is_an_error(results) -> None:
    for rank, r in enumerate(results):
        assert r["rules"]["wrong_device"] == (
            f"WrongDevice: rank {rank}: all_reduce on a cuda group was given a tensor on cpu (shape [2], "
            "torch.float32); NCCL takes tensors on the group's device only"
        )


@pytest.mark.slow
def test_lazy_connection_blocks_the_first_point_to_point_operation_until_the_peers(results) -> None:
    assert results[0]["rules"]["connect_s"] >= 0.25
    for rank, r in enumerate(results):
        assert r["rules"]["receives_first"].startswith(
            f"RulesError: rank {rank}: irecv from rank {1 - rank} is the first point-to-point operation "
            f"with rank {1 - rank} on its group; it blocks until rank {1 - rank} issues its first one"
        )


@pytest.mark.slow
def test_a_device_synchronize_waits_for_every_posted_receive(results) -> None:
    assert results[0]["rules"]["sync"] == ""
    assert results[1]["rules"]["sync"].startswith(
        f"{CollectiveTimeout.__name__}: rank 1: a device synchronize waits for irecv from rank 0"
    )
    assert 0.9 < results[1]["rules"]["sync_s"] < 10


@pytest.mark.slow
def test_receives_posted_at_step_start_each_complete_on_their_own(results) -> None:
    """Finding 1: one ``batch_isend_irecv`` per peer made RECV_B0 wait for B0–B3 (deadlock)."""
    for r in results:
        assert r["pipeline"]["all_posted"] == ""
        assert r["pipeline"]["grad_err"] <= RTOL


@pytest.mark.slow
def test_a_recorded_step_synchronizes_at_most_once(results) -> None:
    """Finding 2: a synchronize after every action waited on receives posted ahead (deadlock)."""
    for r in results:
        assert all(n <= 1 for n in r["pipeline"]["syncs_per_step"]), r["pipeline"]["syncs_per_step"]
        assert r["pipeline"]["spans"] > 0


@pytest.mark.slow
def test_a_synchronize_after_every_action_is_reported_as_the_deadlock_it_is_on_nccl(results) -> None:
    assert results[0]["pipeline"]["sync_each_action"].startswith(
        "CollectiveTimeout: rank 0: a device synchronize waits for irecv from rank 1, which did not "
        "complete within 1 s"
    )


@pytest.mark.slow
def test_boundary_buffers_are_bounded_by_the_microbatches_in_flight(results) -> None:
    """Finding 8: 1F1B holds at most pp microbatches in flight, each with at most one boundary tensor
    sent and one receive posted — not m receive buffers per channel from step start and every send
    until the step ends (pp 2, m 8: 16 before)."""
    for r in results:
        assert r["pipeline"]["held"] <= 2 * 2


# -- CUDA / NCCL: the same on two GPUs --------------------------------------------------------------
def _worker_gpu(rank: int, world: int) -> dict:
    """1F1B at pp 2, m 4 over NCCL, twice: every receive posted at step start (each must complete on
    its own), then a recorded step with the default receive depth (no synchronize between actions)."""
    mesh = ParallelMesh.build(1, world, 1)
    assert mesh.device.type == "cuda" and mesh.backend == "nccl"
    m = 4
    sched = build_schedule("1f1b", world, m)
    tokens, targets = make_batch(1, m, 3)
    out: dict = {"grad_err": 0.0, "loss_err": 0.0}
    for depth, record in ((m, False), (None, True)):
        stages = [st.to(mesh.device) for st in make_stages(world, 3)]
        _, ref_loss, ref_grads = reference(
            stages, [[t.to(mesh.device) for t in tokens[0]]], [[t.to(mesh.device) for t in targets[0]]]
        )
        ex = _executor(sched, mesh, stages, recv_depth=depth, record=record, recv_timeout_s=60)
        syncs = _count_calls(ex, "device_sync")
        mean = ex.global_loss(ex.run(tokens[0], targets[0]))
        errs = [
            rel_err(p.grad, ref_grads[s][n]) for s, st in ex.stages.items() for n, p in st.named_parameters()
        ]
        out["grad_err"] = max(out["grad_err"], *errs)
        out["loss_err"] = max(out["loss_err"], abs(mean - ref_loss) / ref_loss)
        out["syncs"], out["spans"], out["actions"] = len(syncs), len(ex.last_spans), len(ex.actions)
    return out


def _count_calls(obj, name: str) -> list[None]:
    """Wrap ``obj.name`` so that each call appends to the returned list."""
    calls: list[None] = []
    method = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return method(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one GPU per rank)")
def test_executor_on_cuda_with_nccl() -> None:
    for res in spawn(_worker_gpu, 2, (2,), backend="nccl", timeout_s=300):
        assert res["grad_err"] <= 1e-4  # other kernels (and summation orders) than the reference's
        assert res["loss_err"] <= 1e-5
        assert res["syncs"] <= 1  # the recorded step: one synchronize, to read its CUDA events
        assert res["spans"] == res["actions"]
