"""The sharded optimizer's data-parallel reduction as the collectives it runs (cost/sharding.py): a
reduce-scatter of the gradient buffer and an all-gather of the parameters, each priced as its own call,
with exact times on 2 nodes × 2 GPUs under NCCL's model and the α–β model."""

from __future__ import annotations

import pickle

import pytest

from pipewright.cost.llama import cost_class
from pipewright.cost.megatron import reduce_dp
from pipewright.cost.sharding import Reduction, like, reduction_bytes, reduction_calls, reduction_parts
from pipewright.cost.transformer import TransformerCost
from pipewright.ir import REDUCE_GRAD, Action
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.models.spec import ModelSpec
from pipewright.passes.grad_reduce import with_grad_reduction
from pipewright.schedules.registry import build_schedule
from pipewright.sim.engine import simulate
from pipewright.topology import Topology, cluster

SPEC = ModelSpec("t", layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
NCCL = cluster(2, 2, "h100-sxm")
ALPHA_BETA = Topology.from_json({**NCCL.to_json(), "collectives": "alpha-beta"})


@pytest.mark.parametrize(
    ("mode", "grad_dtype", "overlapped", "calls"),
    [
        ("none", "fp32", False, (("all_reduce", 4.0),)),
        ("zero1", "fp32", False, (("reduce_scatter", 4.0), ("all_gather", 2.0))),
        ("zero1", "bf16", False, (("reduce_scatter", 2.0), ("all_gather", 2.0))),
        ("zero1", "fp32", True, (("reduce_scatter", 4.0),)),  # the gather under the next forward
        ("fsdp", "fp32", True, (("reduce_scatter", 4.0), ("all_gather", 2.0))),
    ],
)
def test_the_calls_in_the_dtype_each_moves(mode, grad_dtype, overlapped, calls):
    assert reduction_calls(mode, grad_dtype, "bf16", overlapped) == calls
    per_param = reduction_bytes(mode, grad_dtype, "bf16", overlapped)
    parts = reduction_parts("all_reduce", like(1000 * per_param, per_param))
    assert [k for k, _ in parts] == [k for k, _ in calls]
    assert [b for _, b in parts] == pytest.approx([1000 * b for _, b in calls], rel=1e-15)
    assert reduction_parts("all_gather", 5.0) == (("all_gather", 5.0),)
    assert pickle.loads(pickle.dumps(per_param)).calls == per_param.calls


def _nccl_ring(nbytes: float, bus: float) -> float:
    """NCCL's ring reduce-scatter or all-gather over n = 4 ranks on N = 2 hosts (NVLink inside): 3
    steps, 1 across hosts; per protocol α = base + 2·max(NVLink hop, network post) + 1·network hop,
    bandwidth (LL B/4, LL128 0.92·B, Simple B) × n/steps; the cheapest."""
    ll = (6.6 + 2 * 1.0 + 2.7) * 1e-6 + nbytes / (bus / 4 * 4 / 3)
    ll128 = (14.0 + 2 * 1.9 + 4.0) * 1e-6 + nbytes / (bus * 0.92 * 4 / 3)
    simple = (8.4 + 2 * 3.4 + 14.0) * 1e-6 + nbytes / (bus * 4 / 3)
    return min(ll, ll128, simple)


def _cost(topology: Topology, sharding: str = "zero1", **kw: object) -> TransformerCost:
    mesh = Mesh(tp=1, pp=1, dp=4)
    return TransformerCost(
        SPEC, gpu="h100-sxm", mesh=mesh, topology=topology, optimizer_sharding=sharding, **kw
    )


@pytest.mark.parametrize("topology", [NCCL, ALPHA_BETA], ids=["nccl", "alpha-beta"])
def test_zero1_reduction_is_a_reduce_scatter_then_an_all_gather(topology):
    """The REDUCE_GRAD of the distributed optimizer (gather not overlapped) costs its reduce-scatter of
    the fp32 buffer plus its all-gather of the bf16 parameters — in the simulator, the comm model and
    Megatron's closed form — each at its exact time on 2 nodes × 2 GPUs."""
    cost = _cost(topology, grad_bytes=reduction_bytes("zero1", "fp32"))
    sched = with_grad_reduction(build_schedule("1f1b", 1, 2), "after")
    nbytes = cost.message_bytes(Action(0, REDUCE_GRAD), sched)
    params, eff = cost._chunk(0, sched).params, cost.efficiency.comm
    devices = [cost.comm.device_of(dp=j) for j in range(4)]
    bus, alpha = topology.ring_bandwidth(devices)
    scatter, gather = params * 4.0 / eff, params * 2.0 / eff
    if topology.collectives == "nccl":
        expected = _nccl_ring(scatter, bus) + _nccl_ring(gather, bus)
    else:  # each ring: (n − 1)/n · bytes / B + (n − 1)·α
        expected = 3 / 4 * (scatter + gather) / bus + 2 * 3 * alpha
    assert isinstance(nbytes, Reduction) and float(nbytes) == pytest.approx(params * 3.0, rel=1e-15)
    assert cost.comm.collective_time("all_reduce", 0, nbytes) == pytest.approx(expected, rel=1e-12)
    assert reduce_dp(cost, cost.comm, sched, 0) == pytest.approx(expected, rel=1e-12)
    one_call = cost.comm.collective_time("all_reduce", 0, float(nbytes))  # as it was priced before
    assert one_call != pytest.approx(expected, rel=1e-3)
    compute_only = simulate(build_schedule("1f1b", 1, 2), cost, comm=cost.comm).iteration_time
    reduced = simulate(sched, cost, comm=cost.comm).iteration_time
    assert reduced - compute_only == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("topology", [NCCL, ALPHA_BETA], ids=["nccl", "alpha-beta"])
def test_overlapped_gather_leaves_the_reduce_scatter(topology):
    """``--grad-reduce overlap`` (the cost model's default): the parameter all-gather runs under the next
    forward, so REDUCE_GRAD is the reduce-scatter alone; without sharding one all-reduce."""
    sched = with_grad_reduction(build_schedule("1f1b", 1, 2), "after")
    cost, plain = _cost(topology), _cost(topology, "none")
    params = cost._chunk(0, sched).params
    scatter = cost.comm.collective_time("reduce_scatter", 0, params * 4.0)
    assert cost.comm.collective_time("all_reduce", 0, cost.message_bytes(Action(0, REDUCE_GRAD), sched)) == (
        pytest.approx(scatter, rel=1e-12)
    )
    all_reduce = plain.comm.collective_time("all_reduce", 0, params * 4.0)
    assert reduce_dp(plain, plain.comm, sched, 0) == pytest.approx(all_reduce, rel=1e-12)


def test_expert_gradients_split_the_same_calls_over_their_group():
    """Mixture of experts with ep 2 and ZeRO-1: each call (reduce-scatter of the fp32 buffer, all-gather
    of the parameters) runs the dense share over dp and the routed experts' over their expert-dp group."""
    spec = resolve_model("mixtral-8x7b")
    mesh = Mesh(tp=2, pp=2, dp=8, ep=2)
    cost = cost_class(spec)(
        spec, gpu="h100-sxm", mesh=mesh, topology=cluster(4, 8, "h100-sxm"), attention="flash",
        optimizer_sharding="zero1", grad_bytes=reduction_bytes("zero1", "fp32"),
    )  # fmt: skip
    sched = with_grad_reduction(build_schedule("1f1b", 2, 8), "after")
    nbytes, comm = cost.message_bytes(Action(0, REDUCE_GRAD), sched), cost.comm
    params, expert = float(nbytes) / 3.0, nbytes.expert / 3.0  # 3 all-reduce bytes per parameter
    want = 0.0
    for kind, per_param in (("reduce_scatter", 4.0), ("all_gather", 2.0)):
        want += comm.collective_time(kind, 0, (params - expert) * per_param)
        want += comm.expert_time(kind, 0, expert * per_param)
    assert comm.collective_time("all_reduce", 0, nbytes) == pytest.approx(want, rel=1e-12)


def test_context_parallel_alone_reduces_the_gradients_over_its_replicas():
    """dp = 1, cp = 2: each stage's weights have two copies (Megatron-LM and the runtime all-reduce
    their gradients over dp × cp), so the step holds one REDUCE_GRAD a rank, of the bytes dp = 2 would
    reduce, over the rank's cp group; dp = cp = 1 holds none."""
    from pipewright.plan.setup import model_setup

    def reductions(**mesh):
        mesh = Mesh(pp=2, **mesh)
        topo = cluster(1, mesh.size, "h100-sxm")
        setup = model_setup(SPEC, topo, mesh, build_schedule("1f1b", 2, 4), 1)
        found = [
            (r, a)
            for r, actions in enumerate(setup.schedule.actions)
            for a in actions
            if a.kind == REDUCE_GRAD
        ]
        return setup, [(r, float(setup.cost.message_bytes(a, setup.schedule))) for r, a in found]

    assert reductions()[1] == []
    setup, over_cp = reductions(cp=2)
    assert over_cp == reductions(dp=2)[1] and [r for r, _ in over_cp] == [0, 1]
    assert all(setup.comm.collective_time("all_reduce", r, b) > 0.0 for r, b in over_cp)


def test_the_steps_tensor_parallel_all_reduces():
    """Per stage at tp 2 with sequence parallelism: its replicated parameters' gradients in bf16 (a GPT
    layer's two LayerNorms and two row-parallel biases, 6h; the final LayerNorm 2h on the last; not the
    position table, whose gradient is whole on every tp rank) and, on the rank's first stage, Σg²'s 8
    bytes; without sequence parallelism only Σg²; nothing at tp 1."""
    from pipewright.cost.sharding import tp_step_bytes
    from pipewright.schedules.registry import build_schedule

    spec = resolve_model("gpt", layers=4, hidden=64, heads=4, vocab=256, seq_len=32)
    sched = build_schedule("1f1b", 2, 4)
    cost = TransformerCost(spec, mesh=Mesh(tp=2, pp=2), sequence_parallel=True, grad_dtype="bf16")
    assert tp_step_bytes(cost, 0, sched) == (2 * 6 * 64 * 2, 8.0)
    assert tp_step_bytes(cost, 1, sched) == ((2 * 6 * 64 + 2 * 64) * 2, 8.0)
    plain = TransformerCost(spec, mesh=Mesh(tp=2, pp=2), grad_dtype="bf16")
    assert tp_step_bytes(plain, 1, sched) == (8.0,)
    assert tp_step_bytes(TransformerCost(spec, mesh=Mesh(pp=2)), 1, sched) == ()
