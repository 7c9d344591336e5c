"""Expert gradients are reduced over the expert-data-parallel group (dp·cp/ep ranks holding the same
experts, Megatron-Core's ``expert_data_parallel_group``), the dense parameters' over dp × cp: in the
cost model's REDUCE_GRAD and in the planner's estimate."""

from __future__ import annotations

import pytest

from pipewright.cost.llama import cost_class
from pipewright.cost.moe import MoE, _expert_parameters
from pipewright.cost.moe_cost import ExpertComm, GradBytes
from pipewright.cost.sharding import reduce_dtype_bytes
from pipewright.ir import REDUCE_GRAD, Action
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.passes.grad_reduce import add_grad_reduction
from pipewright.schedules import build_schedule
from pipewright.topology import cluster

MIXTRAL = resolve_model("mixtral-8x7b")
TOPO = cluster(4, 8, "h100-sxm")
SCHED = add_grad_reduction(build_schedule("1f1b", 2, 8))


def _cost(ep: int, cp: int = 1):
    mesh = Mesh(tp=2, pp=2, dp=8 // cp, cp=cp, ep=ep)
    kw = {"gpu": "h100-sxm", "mesh": mesh, "topology": TOPO, "attention": "flash"}
    return cost_class(MIXTRAL)(MIXTRAL, **kw)


@pytest.mark.parametrize(("ep", "cp"), [(2, 1), (4, 1), (2, 2)])
def test_the_expert_gradients_bytes_and_groups(ep, cp):
    cost = _cost(ep, cp)
    dp = 8 // cp
    routed = MIXTRAL.moe_experts // ep * _expert_parameters(MIXTRAL, MoE(8, 2)) / 2  # per device, t = 2
    for stage in (0, 1):
        got = cost.grad_reductions(stage, SCHED)
        params = cost._chunk(stage, SCHED).params
        expert = MIXTRAL.layers // 2 * routed * cost.grad_bytes
        assert got["expert_dp"] == pytest.approx(expert, rel=1e-12)
        assert got["dp"] == pytest.approx(params * cost.grad_bytes - expert, rel=1e-12)
        nbytes = cost.message_bytes(Action(stage, REDUCE_GRAD), SCHED)
        assert isinstance(nbytes, GradBytes) and nbytes == pytest.approx(params * cost.grad_bytes)
    comm = cost.comm
    assert isinstance(comm, ExpertComm)
    group = comm.expert_group(0)
    assert len(group) == dp * cp // ep and len(cost.mesh.grad_group(0)) == dp * cp
    assert len({cost.mesh.ep_rank(g) for g in group}) == 1  # the same experts on every member
    # REDUCE_GRAD: the dense bytes over dp × cp, then the expert bytes over the expert-dp group
    nbytes = cost.message_bytes(Action(0, REDUCE_GRAD), SCHED)
    devices = [comm._device(g) for g in group]
    want = comm.collective_time("all_reduce", 0, nbytes - nbytes.expert) + TOPO.collective_time(
        "all_reduce", devices, nbytes.expert / comm.bandwidth_efficiency
    )
    assert comm.collective_time("all_reduce", 0, nbytes) == pytest.approx(want, rel=1e-12)
    everything_over_dp = comm.collective_time("all_reduce", 0, float(nbytes))
    assert everything_over_dp != pytest.approx(want, rel=1e-3)


def test_without_expert_parallelism_every_gradient_is_reduced_over_dp():
    cost = _cost(1)
    nbytes = cost.message_bytes(Action(0, REDUCE_GRAD), SCHED)
    assert not isinstance(nbytes, GradBytes) and not isinstance(cost.comm, ExpertComm)
    assert cost.grad_reductions(0, SCHED)["expert_dp"] == 0.0


def test_the_planners_estimate_reduces_the_experts_over_their_group():
    from dataclasses import replace

    from pipewright.plan.problem import Candidate, Problem
    from pipewright.plan.search_context import messages

    spec = replace(MIXTRAL, layers=4, moe_dense_layers=1)
    prob = Problem(spec, TOPO, 32, attention="flash")
    c = Candidate(2, 2, 8, 1, 4, "1f1b", ep=4)
    dense, expert = messages(prob, c)[1](2, False)  # rank 0: one dense layer and one MoE layer
    routed = 2 * _expert_parameters(spec, MoE(8, 2)) / 2  # 8/4 experts per device, t = 2
    assert expert == pytest.approx(routed * 4.0, rel=1e-12)  # all-reduced from the fp32 gradient buffer
    cost = cost_class(spec)(spec, gpu="h100-sxm", mesh=Mesh(2, 2, 8, ep=4), topology=TOPO, attention="flash")
    sched = add_grad_reduction(build_schedule("1f1b", 2, 4))
    assert (dense, expert) == pytest.approx(tuple(cost.grad_reductions(0, sched).values()), rel=1e-12)


def test_fsdp_without_pipelining_moves_the_expert_weights_over_their_group():
    """pp = 1, FSDP: each layer's all-gather and reduce-scatter split as REDUCE_GRAD's — the routed
    experts over the expert-data-parallel group, the rest over dp × cp."""
    mesh = Mesh(tp=2, pp=1, dp=16, ep=4)
    kw = {"gpu": "h100-sxm", "mesh": mesh, "topology": TOPO, "attention": "flash"}
    cost = cost_class(MIXTRAL)(MIXTRAL, optimizer_sharding="fsdp", **kw)
    sched = build_schedule("1f1b", 1, 4)
    chunk, comm = cost._chunk(0, sched), cost.comm
    expert = MIXTRAL.layers * cost.routed_params()
    dense = chunk.params - expert
    assert len(comm.expert_group(0)) == 4 and len(mesh.grad_group(0)) == 16
    gather = comm.collective_time("all_gather", 0, dense * 2.0) + comm.expert_time(
        "all_gather", 0, expert * 2.0
    )
    reduced = reduce_dtype_bytes(cost.grad_dtype, cost.dtype)  # the gradient buffer's dtype, as dense FSDP
    scatter = comm.collective_time("reduce_scatter", 0, dense * reduced) + comm.expert_time(
        "reduce_scatter", 0, expert * reduced
    )
    assert cost._fsdp_comm(chunk, "F", 0) == pytest.approx(gather, rel=1e-12)
    assert cost._fsdp_comm(chunk, "B", 0) == pytest.approx(gather + scatter, rel=1e-12)
    over_dp = comm.collective_time("all_gather", 0, chunk.params * 2.0)
    # the experts' share over 4 ranks one per node (ep ranks are the node's neighbours), not over 16
    assert cost._fsdp_comm(chunk, "F", 0) != pytest.approx(over_dp, rel=1e-3)
