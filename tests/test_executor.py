"""The pipeline runtime: mesh arithmetic, split backward, and the executor against a single-process
reference (same loss, same gradients) for every synchronous schedule in the registry, on gloo.

Multi-process checks launch once per world size and run all their cases inside the workers; the
workers return plain numbers and the tests assert on them.
"""

from __future__ import annotations

import copy
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as hs
from torch import nn

from _queue_spawn import fork_launch
from pipewright.deps import CORE_KINDS
from pipewright.errors import PipewrightError
from pipewright.ir import REDUCE_GRAD, Action, KindSpec, Schedule, W, v_placement
from pipewright.passes import lower
from pipewright.passes.grad_reduce import add_grad_reduction
from pipewright.runtime import (
    DeferrableLinear,
    LayoutError,
    ParallelMesh,
    PipelineExecutor,
    RecvTimeout,
    WeightGradStore,
    WorkerError,
    coords_to_rank,
    defer_weight_grads,
    gather_timeline,
    rank_to_coords,
    spawn,
)
from pipewright.runtime.core.executor import default_handlers
from pipewright.runtime.parallel.process_mesh import check_layout
from pipewright.schedules import build_schedule
from pipewright.schedules.registry import check_args, info, schedule_names

HIDDEN, VOCAB, MB, SEQ = 8, 11, 2, 3
LAYOUTS_8 = ((1, 2, 4), (2, 2, 2), (1, 4, 2), (2, 4, 1))  # (dp, pp, tp); tp replicas repeat the work
RTOL = 1e-5


# -- the tiny model -----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = DeferrableLinear(HIDDEN, 2 * HIDDEN)
        self.down = DeferrableLinear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    """One block; the first stage embeds tokens, the last adds a norm and the vocabulary head."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if first else None
        self.block = Block()
        self.head = nn.Sequential(nn.LayerNorm(HIDDEN), DeferrableLinear(HIDDEN, VOCAB)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_stages(num_stages: int, seed: int) -> list[Stage]:
    torch.manual_seed(seed)
    return [Stage(s == 0, s == num_stages - 1) for s in range(num_stages)]


def make_batch(dp: int, m: int, seed: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Microbatches per dp replica: tokens and targets of shape (MB, SEQ)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (dp, m, MB, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (dp, m, MB, SEQ), generator=g)
    return [list(t) for t in tokens], [list(t) for t in targets]


def reference(
    stages: list[Stage], tokens, targets
) -> tuple[list[list[float]], float, list[dict[str, torch.Tensor]]]:
    """Full batch on one process: per-microbatch losses, the mean loss over all dp × m microbatches,
    and per-stage gradients of that mean."""
    model = nn.Sequential(*copy.deepcopy(stages))
    x = torch.cat([t for rep in tokens for t in rep])
    y = torch.cat([t for rep in targets for t in rep])
    full = loss_fn(model(x), y)
    full.backward()
    losses = [
        [loss_fn(model(t), u).item() for t, u in zip(r1, r2, strict=True)]
        for r1, r2 in zip(tokens, targets, strict=True)
    ]
    return losses, full.item(), [{n: p.grad.clone() for n, p in st.named_parameters()} for st in model]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _cases_8() -> list[tuple[str, tuple[int, int, int], int, int]]:
    """(schedule, (dp, pp, tp), v, m) for every synchronous schedule, layout and supported v ≤ 2,
    plus a hand-written V-placement schedule with split backward (local hand-offs, I and W)."""
    cases = []
    for name in (*schedule_names(distinct_orders=True), V_SPLIT):
        entry = None if name == V_SPLIT else info(name)
        if entry is not None and not entry.synchronous:
            continue
        for dp, pp, tp in LAYOUTS_8:
            for v in (1, 2):
                if (entry is None and v != 2) or (
                    entry is not None and entry.chunks is not None and v not in entry.chunks
                ):
                    continue
                m = _microbatches(name, pp, v)
                if m is not None:
                    cases.append((name, (dp, pp, tp), v, m))
    return cases


V_SPLIT = "v-gpipe-split"


def v_gpipe_split(p: int, m: int) -> Schedule:
    """V placement (rank r holds stages r and 2p−1−r): all forwards down and up the V, then input
    gradients back, then all weight gradients. Exercises local hand-offs and deferred W."""
    placement = v_placement(p)
    rows = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        row = [Action(first, "F", k) for k in range(m)] + [Action(second, "F", k) for k in range(m)]
        row += [Action(second, "I", k) for k in range(m)] + [Action(first, "I", k) for k in range(m)]
        row += [Action(s, W, k) for s in (second, first) for k in range(m)]
        rows.append(row)
    return Schedule(V_SPLIT, p, 2 * p, m, placement, tuple(map(tuple, rows)))


def _build(name: str, p: int, m: int, v: int) -> Schedule:
    return v_gpipe_split(p, m) if name == V_SPLIT else build_schedule(name, p, m, v)


def _microbatches(name: str, p: int, v: int) -> int | None:
    if name == V_SPLIT:
        return p
    for m in range(max(2, p), 4 * p + 1):
        try:
            check_args(name, p, m, v)
            return m
        except PipewrightError:
            continue
    return None


def _executor(schedule: Schedule, mesh: ParallelMesh, stages: list[Stage], **kwargs) -> PipelineExecutor:
    mine = {s: stages[s] for s in schedule.stages_of(mesh.pp_rank)}
    kwargs.setdefault("recv_timeout_s", 60)
    return PipelineExecutor(schedule, mesh, mine, loss_fn=loss_fn, boundary_shape=(MB, SEQ, HIDDEN), **kwargs)


def _run_case(mesh: ParallelMesh, name: str, v: int, m: int, seed: int) -> dict:
    schedule = _build(name, mesh.pp, m, v)
    stages = make_stages(schedule.num_stages, seed)
    tokens, targets = make_batch(mesh.dp, m, seed)
    ref_losses, ref_loss, ref_grads = reference(stages, tokens, targets)
    # I must leave the stage's weight-gradient work in its W store (not do it at once)
    deferred: list[bool] = []
    input_backward = default_handlers()["I"]

    def checked_input_backward(state, a: Action) -> None:
        input_backward(state, a)
        pending = state.executor.wgrad[a.stage].keys()
        deferred.append(a.microbatch in pending)

    # Alternate cases post all receives at iteration start or only one action ahead.
    window = None if seed % 2 == 0 else 1
    ex = _executor(schedule, mesh, stages, recv_window=window, handlers={"I": checked_input_backward})
    d = mesh.dp_rank
    eval_losses = ex.evaluate(tokens[d], targets[d])
    untouched = all(p.grad is None for st in ex.stages.values() for p in st.parameters())
    losses = ex.run(tokens[d], targets[d])
    mean = ex.global_loss(losses)
    errs = [rel_err(p.grad, ref_grads[s][n]) for s, st in ex.stages.items() for n, p in st.named_parameters()]
    result = {"grad_err": max(errs), "num_params": len(errs), "loss_err": 0.0, "losses": len(losses)}
    result["mean_loss_err"] = abs(mean - ref_loss) / ref_loss
    if schedule.num_stages - 1 in ex.stages:
        pairs = [*zip(losses, ref_losses[d], strict=True), *zip(eval_losses, ref_losses[d], strict=True)]
        result["loss_err"] = max(abs(a - b) / abs(b) for a, b in pairs)
    result["eval_ok"] = untouched and len(eval_losses) == len(losses)
    result["i_defers"] = all(deferred)
    return result


def _worker_8(rank: int, cases: list) -> dict:
    results, meshes = {}, {}
    for name, layout, v, m in cases:
        if layout not in meshes:
            meshes[layout] = ParallelMesh.build(*layout)
        results[(name, layout, v, m)] = _run_case(meshes[layout], name, v, m, seed=len(results))
    results["misc"] = _misc_checks(rank, meshes[(1, 2, 4)])
    return results


CASES_8 = _cases_8()


@pytest.fixture(scope="module")
def results_8() -> list[dict]:
    return fork_launch(_worker_8, 8, (CASES_8,), timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", CASES_8, ids=lambda c: f"{c[0]}-dp{c[1][0]}pp{c[1][1]}tp{c[1][2]}-v{c[2]}-m{c[3]}"
)
def test_executor_matches_single_process_reference(results_8, case) -> None:
    name, (dp, pp, tp), v, m = case
    sched = _build(name, pp, m, v)
    last_pp = sched.rank_of(sched.num_stages - 1)
    for rank, res in enumerate(results_8):
        r = res[case]
        assert r["num_params"] > 0
        assert r["eval_ok"], f"rank {rank}: evaluate() touched gradients or lost losses"
        assert r["i_defers"], f"rank {rank}: an I action did the weight-gradient work itself"
        assert r["grad_err"] <= RTOL, f"rank {rank}: gradient differs by {r['grad_err']:.2e}"
        assert r["loss_err"] <= RTOL, f"rank {rank}: loss differs by {r['loss_err']:.2e}"
        assert r["mean_loss_err"] <= RTOL, f"rank {rank}: global loss differs by {r['mean_loss_err']:.2e}"
        holds_last = rank_to_coords(rank, dp, pp, tp)[1] == last_pp
        assert r["losses"] == (m if holds_last else 0)


# -- timeline, extension kinds, asynchronous steps, timeout: pp = 2 (× tp 4 replicas) ---------------
def _misc_checks(rank: int, mesh: ParallelMesh) -> dict:
    out: dict = {}
    m = 4
    stages = make_stages(2, 0)
    tokens, targets = make_batch(1, m, 0)
    # Measured timeline of 1F1B gathered to rank 0.
    ex = _executor(build_schedule("1f1b", 2, m), mesh, stages, record=True)
    ex.run(tokens[0], targets[0])
    timeline = gather_timeline(ex.last_spans, mesh)
    if rank == 0:
        out["timeline"] = (timeline.num_ranks, timeline.source, sorted(str(s.action) for s in timeline.spans))
        out["expected"] = sorted(str(a) for row in ex.schedule.actions for a in row)
        out["ordered"] = all(s.end >= s.start for s in timeline.spans)
    # Scatter/gather over the 4 tp ranks (they hold identical boundary tensors): same gradients.
    sg_stages = make_stages(2, 5)
    _, _, ref_grads = reference(sg_stages, tokens, targets)
    ex = _executor(build_schedule("1f1b", 2, m), mesh, sg_stages, scatter_gather=True)
    ex.run(tokens[0], targets[0])
    st = sg_stages[mesh.pp_rank]
    out["scatter_gather_err"] = max(
        rel_err(p.grad, ref_grads[mesh.pp_rank][n]) for n, p in st.named_parameters()
    )
    # An extension kind with its own handler (no change to the executor).
    note = KindSpec("NOTE", requires=lambda a, s: (), compute=False)
    sched = build_schedule("1f1b", 2, m)
    rows = [[*row, Action(r, "NOTE")] for r, row in enumerate(sched.actions)]
    ext = sched.with_actions(rows, kinds=CORE_KINDS.with_kinds(note))
    seen: list[str] = []
    _executor(ext, mesh, stages, handlers={"NOTE": lambda state, a: seen.append(str(a))}).run(
        tokens[0], targets[0]
    )
    out["note"] = seen
    # Asynchronous schedules: STEP(s, k) calls step_fn after each microbatch's backward.
    out["steps"] = {}
    for name in schedule_names():
        if not info(name).synchronous:
            steps: list[tuple[int, int | None]] = []
            ex = _executor(
                build_schedule(name, 2, m),
                mesh,
                stages,
                step_fn=lambda s, k, steps=steps: steps.append((s, k)),
            )
            ex.run(tokens[0], targets[0])
            out["steps"][name] = steps
    # A rank whose schedule never sends its gradients: the peer's receive must time out, named.
    dist.barrier()
    broken = lower(build_schedule("gpipe", 2, 2))
    if mesh.pp_rank == 1:
        broken = broken.with_actions(
            [broken.actions[0], [a for a in broken.actions[1] if a.kind != "SEND_B"]]
        )
    ex = _executor(broken, mesh, make_stages(2, 1), recv_timeout_s=1.0, validate=False)
    tokens, targets = make_batch(1, 2, 1)
    start = time.perf_counter()
    try:
        ex.run(tokens[0], targets[0])
        out["timeout"] = None
    except RecvTimeout as e:
        out["timeout"] = (str(e), time.perf_counter() - start)
    dist.barrier()  # pp rank 1 stays alive (its peer's receive must time out, not see a closed socket)
    return out


@pytest.mark.slow
def test_measured_timeline_has_every_action(results_8) -> None:
    num_ranks, source, actions = results_8[0]["misc"]["timeline"]
    assert (num_ranks, source) == (2, "measured")
    assert actions == results_8[0]["misc"]["expected"]
    assert results_8[0]["misc"]["ordered"]


@pytest.mark.slow
def test_scatter_gather_over_tp_gives_the_same_gradients(results_8) -> None:
    for res in results_8:
        assert res["misc"]["scatter_gather_err"] <= RTOL


@pytest.mark.slow
def test_extension_kind_handler_and_async_steps(results_8) -> None:
    for rank, res in enumerate(results_8):
        pp_rank = rank_to_coords(rank, 1, 2, 4)[1]
        assert res["misc"]["note"] == [f"{pp_rank}NOTE"]
        for name, steps in res["misc"]["steps"].items():
            assert steps == [(pp_rank, k) for k in range(4)], name


@pytest.mark.slow
def test_missing_send_times_out_naming_rank_action_and_peer(results_8) -> None:
    for rank, res in enumerate(results_8):
        if rank_to_coords(rank, 1, 2, 4)[1] == 1:
            assert res["misc"]["timeout"] is None
            continue
        message, waited = res["misc"]["timeout"]
        peer = coords_to_rank(0, 1, rank % 4, 1, 2, 4)
        assert message.startswith(f"rank {rank} (pp 0): 0RECV_B0 received nothing from rank {peer} (pp 1)")
        assert waited < 30


def _dying_worker(rank: int) -> None:
    if rank == 1:
        raise ValueError("worker 1 exploded")
    dist.recv(torch.zeros(1), src=1)  # would wait forever


@pytest.mark.slow
def test_dying_worker_stops_the_run() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker rank 1 failed: ValueError: worker 1 exploded") as info_:
        spawn(_dying_worker, 2, backend="gloo", timeout_s=60)
    assert info_.value.rank == 1
    assert time.monotonic() - start < 60


def _aborts_at_exit(rank: int) -> int:
    if rank == 1:  # dies by SIGABRT after its work, as a C++ teardown abort would
        import multiprocessing.util

        multiprocessing.util.Finalize(None, os.abort, exitpriority=0)
    return 10 * rank


@pytest.mark.slow
def test_a_crash_after_every_result_is_written_keeps_the_results(caplog) -> None:
    """A worker that dies only after all ranks wrote their results and passed the final barrier (a
    teardown abort) does not fail the run: the results come back, with a warning."""
    with caplog.at_level(logging.WARNING, logger="pipewright.runtime.setup.launch"):
        assert spawn(_aborts_at_exit, 2, backend="gloo", timeout_s=60) == [0, 10]
    assert "after all results were written" in caplog.text


# -- single-process checks ------------------------------------------------------------------------
def test_rank_coordinates_round_trip_and_layout_errors() -> None:
    dp, pp, tp = 2, 3, 4
    seen = set()
    for r in range(dp * pp * tp):
        c = rank_to_coords(r, dp, pp, tp)
        assert coords_to_rank(*c, dp, pp, tp) == r
        seen.add(c)
    assert len(seen) == 24
    assert rank_to_coords(5, dp, pp, tp) == (1, 0, 1)  # tp fastest, then dp, then pp (Megatron's tp-dp-pp)
    assert rank_to_coords(5, dp, pp, tp, order="tp-pp-dp") == (0, 1, 1)
    with pytest.raises(LayoutError, match="2×2×2 = 8 but there are 6 processes"):
        check_layout(6, 2, 2, 2)


@given(hs.integers(1, 4), hs.integers(1, 4), hs.integers(1, 4), hs.data())
def test_rank_coordinates_are_a_bijection(dp: int, pp: int, tp: int, data) -> None:
    rank = data.draw(hs.integers(0, dp * pp * tp - 1))
    d, p, t = rank_to_coords(rank, dp, pp, tp)
    assert (0 <= d < dp, 0 <= p < pp, 0 <= t < tp) == (True, True, True)
    assert coords_to_rank(d, p, t, dp, pp, tp) == rank


def test_deferred_weight_grads_equal_full_backward() -> None:
    torch.manual_seed(0)
    stage = Stage(True, True)
    ref = copy.deepcopy(stage)
    # Reference: plain nn.Linear modules with the same weights (DeferrableLinear is a drop-in).
    for parent in [ref.block, ref.head]:
        for name, child in list(parent.named_children()):
            if isinstance(child, DeferrableLinear):
                plain = nn.Linear(child.in_features, child.out_features)
                plain.load_state_dict(child.state_dict())
                setattr(parent, name, plain)
    assert set(ref.state_dict()) == set(stage.state_dict())
    tokens, targets = make_batch(1, 2, 0)
    for t, y in zip(tokens[0], targets[0], strict=True):
        loss_fn(ref(t), y).backward()
    store = WeightGradStore()
    for k, (t, y) in enumerate(zip(tokens[0], targets[0], strict=True)):
        with defer_weight_grads(store, stage, key=k):
            loss_fn(stage(t), y).backward()
    assert stage.block.up.weight.grad is None and len(store) == 6
    assert stage.block.norm.weight.grad is not None  # non-linear parameters get theirs in I
    store.flush(0)
    store.flush(1)
    assert len(store) == 0
    for (n, p), q in zip(stage.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=n)


def test_grad_reduction_follows_last_weight_gradient() -> None:
    sched = build_schedule("1f1b", 2, 3)
    out = add_grad_reduction(sched)
    for rank, row in enumerate(out.actions):
        assert row[-1] == Action(rank, REDUCE_GRAD)
        assert [a for a in row if a.kind != REDUCE_GRAD] == list(sched.actions[rank])
    assert add_grad_reduction(out) is out
    # Split backward, two stages on one rank: each reduction follows its stage's last W, not its I.
    rows = [[Action(0, "F", 0), Action(1, "F", 0), Action(1, "I", 0), Action(1, W, 0), Action(0, "I", 0)]]
    rows[0].append(Action(0, W, 0))
    split = sched.with_actions(rows, num_ranks=1, num_stages=2, num_microbatches=1, placement=(0, 0))
    reduced = add_grad_reduction(split).actions[0]
    assert reduced[4] == Action(1, REDUCE_GRAD) and reduced[-1] == Action(0, REDUCE_GRAD)
    assert len(reduced) == len(rows[0]) + 2


# -- CUDA / NCCL ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deferred_weight_grads_on_cuda() -> None:
    torch.manual_seed(0)
    layer = DeferrableLinear(8, 4).cuda()
    ref = nn.Linear(8, 4).cuda()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3, 5, 8, device="cuda")
    ref(x).square().sum().backward()
    store = WeightGradStore()
    with defer_weight_grads(store, layer, key=0):  # backward runs on autograd's CUDA thread
        layer(x).square().sum().backward()
    assert layer.weight.grad is None
    store.flush()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
