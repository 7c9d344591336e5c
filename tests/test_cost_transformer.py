"""Analytical transformer cost: Megatron's FLOP count, memory formulas, tensor parallelism, PTD-P mapping."""

import pytest

from pipewright.cost import CostModel, Efficiency, Mesh, TopologyComm, TransformerCost
from pipewright.cost.chunk_memory import deferred_grad_output_bytes
from pipewright.cost.transformer import megatron_flops_per_iteration, megatron_parameters
from pipewright.errors import ConfigError, PipewrightError
from pipewright.hardware import accelerator
from pipewright.ir import REDUCE_GRAD, Action, B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.schedules.registry import build_schedule
from pipewright.topology import cluster, heterogeneous

SPEC = ModelSpec("t", layers=8, hidden=256, heads=8, vocab=1000, seq_len=128)
NO_MEMORY = Efficiency(gemm=0.5, memory_traffic=0.0, comm=1.0)


def total(cost, schedule, fn):
    return sum(fn(a, schedule) for row in schedule.actions for a in row)


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_flops_per_iteration_match_megatron(recompute):
    p, m, b, t, d = 4, 6, 2, 2, 3
    schedule = build_schedule("1f1b", p, m)
    cost = TransformerCost(SPEC, microbatch=b, recompute=recompute, mesh=Mesh(tp=t, pp=p, dp=d))
    assert isinstance(cost, CostModel)
    executed = total(cost, schedule, cost.flops) * t * d
    model = total(cost, schedule, cost.model_flops) * t * d
    assert executed == pytest.approx(megatron_flops_per_iteration(SPEC, b * m * d, recompute), rel=1e-12)
    assert model == pytest.approx(megatron_flops_per_iteration(SPEC, b * m * d, "none"), rel=1e-12)


def test_split_backward_adds_up():
    schedule = build_schedule("1f1b", 2, 2)
    cost = TransformerCost(SPEC, microbatch=1, recompute="full")
    for s in (0, 1):
        b, i, w = (cost.flops(Action(s, k, 0), schedule) for k in (B, I, W))
        assert b == pytest.approx(i + w)
        f = cost.flops(Action(s, F, 0), schedule)
        assert i > w  # the recomputed forward sits in I
        if s == 0:
            assert b == pytest.approx(3 * f)  # 2× backward + recomputed forward, no logit layer


def test_activation_bytes():
    s, b, h, a = SPEC.seq_len, 2, SPEC.hidden, SPEC.heads
    schedule = build_schedule("1f1b", 4, 4)  # stages 1 and 2 hold two layers and nothing else
    plain = TransformerCost(SPEC, microbatch=b, dtype="fp16")
    f = plain.activation_bytes(Action(1, F, 0), schedule)
    assert f == 2 * (34 * s * b * h + 5 * a * s * s * b)
    handed = deferred_grad_output_bytes(plain, 2, False)  # I hands the output gradients to W
    assert handed == 2 * 18 * s * b * h  # 2 bytes × (3h + h + 4h + h) outputs a token
    # W frees Zero Bubble's 32·s·b·h a layer: the linear layers' inputs, 2 × (3h + f) = 14·s·b·h,
    # and the output gradients I handed it
    assert plain.activation_bytes(Action(1, W, 0), schedule) == -2 * 32 * s * b * h
    assert (
        f
        + plain.activation_bytes(Action(1, I, 0), schedule)
        + plain.activation_bytes(Action(1, W, 0), schedule)
        == 0
    )
    assert plain.activation_bytes(Action(1, B, 0), schedule) == -f
    recomputed = TransformerCost(SPEC, microbatch=b, dtype="fp16", recompute="full")
    assert recomputed.activation_bytes(Action(1, F, 0), schedule) == 2 * 2 * s * b * h
    tp = TransformerCost(SPEC, microbatch=b, dtype="fp16", mesh=Mesh(tp=2), sequence_parallel=True)
    assert tp.activation_bytes(Action(1, F, 0), schedule) == f / 2


def test_tensor_parallel_halves_compute_and_adds_all_reduces():
    schedule = build_schedule("1f1b", 4, 4)
    one = TransformerCost(SPEC, microbatch=1, efficiency=NO_MEMORY, mesh=Mesh(pp=4), topology=cluster(1, 8))
    two = TransformerCost(
        SPEC, microbatch=1, efficiency=NO_MEMORY, mesh=Mesh(tp=2, pp=4), topology=cluster(1, 8)
    )
    act = SPEC.seq_len * SPEC.hidden * 2
    ar = two.topology.collective_time("all_reduce", [0, 1], act)
    # NCCL's model at n = 2 on one host, a 64 KiB message: ring LL, 6.6 µs + 2 NVLink steps × 0.6 µs, B/4
    assert ar == pytest.approx(act / (300e9 / 4) + (6.6 + 2 * 0.6) * 1e-6)
    # a launched NCCL call takes at least 2(n − 1) ring steps of the A100's measured step latency
    # (vTrain's 93 µs for a 1 MiB all-reduce over 8 A100s, 14 steps): above the model's time here
    ar = max(ar, 2 * accelerator("a100-80gb").collective_step_latency)
    assert two.comm.tp_all_reduce_time(1, act) == pytest.approx(ar)
    stage = Action(1, F, 0)  # two layers: 2 all-reduces each in the forward
    assert two.compute_time(stage, schedule) == pytest.approx(one.compute_time(stage, schedule) / 2 + 4 * ar)
    assert one.compute_time(stage, schedule) == pytest.approx(one.flops(stage, schedule) / (312e12 * 0.5))
    # backward: 2 per layer, all in I
    bwd = Action(1, B, 0)
    assert two.compute_time(bwd, schedule) == pytest.approx(one.compute_time(bwd, schedule) / 2 + 4 * ar)
    assert two.compute_time(Action(1, W, 0), schedule) == pytest.approx(
        one.compute_time(Action(1, W, 0), schedule) / 2
    )
    assert two.message_bytes(Action(1, "SEND_F", 0), schedule) == act / 2
    assert one.message_bytes(Action(1, "SEND_F", 0), schedule) == act


def test_static_memory_and_gradients():
    schedule = build_schedule("1f1b", 4, 4)
    cost = TransformerCost(SPEC, microbatch=1)
    params = sum(cost.static_bytes(r, schedule) for r in range(4)) / 18
    h, V = SPEC.hidden, SPEC.vocab
    assert params == pytest.approx(megatron_parameters(SPEC) + V * h + 2 * h)  # + output layer, final LN
    stage = 2 * (12 * h * h + 13 * h)  # two layers' parameters
    # bf16 training with an fp32 gradient buffer all-reduces 4 bytes per parameter (Megatron-LM's
    # accumulate_allreduce_grads_in_fp32 for --bf16); a bf16 buffer 2
    assert cost.message_bytes(Action(1, REDUCE_GRAD), schedule) == stage * 4
    bf16 = TransformerCost(SPEC, microbatch=1, grad_dtype="bf16")
    assert bf16.message_bytes(Action(1, REDUCE_GRAD), schedule) == stage * 2


def test_layout_and_errors():
    schedule = build_schedule("1f1b", 2, 2)
    cost = TransformerCost(SPEC, layout=(6, 2))
    assert cost.flops(Action(0, F, 0), schedule) > 2 * cost.flops(Action(1, F, 0), schedule)
    with pytest.raises(ConfigError, match="must give 2 stages summing to 8 layers"):
        TransformerCost(SPEC, layout=(4, 2)).flops(Action(0, F, 0), schedule)
    with pytest.raises(ConfigError, match="--recompute"):
        TransformerCost(SPEC, recompute="some")
    with pytest.raises(PipewrightError, match="v100 has no bf16 peak"):
        TransformerCost(SPEC, gpu="v100", dtype="bf16")
    with pytest.raises(ConfigError, match="--tp 3 must divide"):
        TransformerCost(SPEC, mesh=Mesh(tp=3))


def test_ptdp_mapping():
    mesh = Mesh(tp=2, pp=2, dp=2)
    assert mesh.global_rank(1) == 4 and mesh.tp_group(1) == (4, 5) and mesh.dp_group(0) == (0, 2)
    topo = cluster(2, 4)
    comm = TopologyComm(topo, mesh)
    assert comm.device(1) == "node1/gpu0"
    assert comm.p2p_time(0, 1, 1e6) == topo.p2p_time(0, 4, 1e6)
    assert comm.collective_time("all_reduce", 1, 1e6) == topo.collective_time("all_reduce", [4, 6], 1e6)
    with pytest.raises(ConfigError, match="pipeline rank 2 is outside the mesh's pp = 2"):
        comm.p2p_time(0, 2, 1)
    with pytest.raises(ConfigError, match="= 16 ranks, but topology"):
        TopologyComm(topo, Mesh(tp=2, pp=4, dp=2))


def test_heterogeneous_devices_set_each_stage_speed():
    topo = heterogeneous([(1, 2, "a100-80gb"), (1, 2, "h100-sxm")])
    cost = TransformerCost(SPEC, efficiency=NO_MEMORY, mesh=Mesh(pp=4), topology=topo)
    schedule = build_schedule("1f1b", 4, 4)
    a100, h100 = (cost.compute_time(Action(s, F, 0), schedule) for s in (1, 2))
    assert a100 / h100 == pytest.approx(989.5 / 312)
