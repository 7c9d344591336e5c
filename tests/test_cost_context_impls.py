"""Context-parallel implementations (pipewright.cost.cp_impls, ``--cp-comm``): exact bytes, exposed
seconds and memory-bound bytes of each on a tiny shape with a linear transfer price, the order of
PyTorch's ring loop on two streams, the framework defaults, the one-line error and the published rows
that name an implementation."""

from __future__ import annotations

import typing

import pytest

from pipewright.cli import _parser
from pipewright.cost import cp_impls, frameworks
from pipewright.cost.context_parallel import cp_layer_seconds
from pipewright.cost.cp_impls import CPComm, CPShape, cp_impl, run_streams
from pipewright.cost.published_specs import published_spec
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.plan.spec_inputs import with_framework_defaults
from pipewright.runspec.choices import CpComm

# s = 16 tokens, c = 2: 8 per rank; a = 4 query heads and g = 2 key/value heads of d = 8
SPEC = ModelSpec("cp", 2, 32, 4, 64, 16, family="llama", kv_heads=2)
GB = 1e9  # the test's transfer price: one byte per nanosecond, no latency
COMM = CPComm(lambda n: n / GB, lambda n: n / GB, 2)
GQA = 8 * 2 * 2 * 8  # b·(s/c)·2·g·d = 256 elements
REPEATED = 8 * 2 * 4 * 8  # b·(s/c)·2·a·d = 512 elements (repeat_kv to the query heads)
OUT = 8 * 4 * 8  # b·(s/c)·a·d = 256 elements


def _shape(fused: bool = False) -> CPShape:
    return CPShape(SPEC, 1, 2, 1, 2, fused)


def test_two_streams_run_transfers_in_posting_order():
    prog = [
        ("post", "x", 3.0),
        ("compute", 1.0),
        ("post", "y", 2.0),
        ("wait", "x"),
        ("compute", 1.0),
        ("wait", "y"),
    ]
    # x on [0, 3]; y queued behind it on [3, 5]; the compute waits x at 1 → 3, runs to 4, waits y → 5
    assert run_streams(prog) == (5.0, 2.0)


def test_torch_allgather_forward_exact():
    attn = 2e-6  # two kernel calls of 1 µs
    got = cp_impl("torch-allgather").kind_pass(_shape(), COMM, F, attn, attn, False)
    block = REPEATED * 2  # 1024 bytes
    gather = 2 * block / GB  # all c blocks, 2.048 µs, waited after the diagonal block's 1 µs
    assert got.sent_bytes == block
    assert got.comm_s == pytest.approx(gather)
    assert got.exposed_s == pytest.approx(gather - 1e-6)
    # eager: K, V contiguous + one cat (2·512·2 each) and the merge over 256 outputs:
    # cast 6, one merge step 6 + 32, cast back 6
    assert got.traffic_bytes == 2 * 2048 + OUT * (6 + 38 + 6)
    assert (got.kernel_calls, got.buffer_bytes) == (2, 2 * block)
    fused = cp_impl("torch-allgather").kind_pass(_shape(True), COMM, F, attn, attn, False)
    assert fused.traffic_bytes == 2 * 2048 + OUT * (6 + 10 + 6)  # one pass per merge step: 4 + 2 + 4


def test_torch_backward_waits_the_last_accumulator():
    attn = 2e-6
    for name in ("torch-allgather", "torch-alltoall"):
        got = cp_impl(name).kind_pass(_shape(), COMM, I, attn, 0.0, False)
        gather, dkv = 2 * 1024 / GB, 2 * 2048 / GB  # K/V (bf16) and one fp32 dK/dV permute (1 step)
        # K/V on [0, 2.048]; dK/dV 0 queued behind it to 6.144; step 1 runs [2.048, 3.048], waits it,
        # sends dK/dV 1, waited after the loop: 10.24 µs for 2 µs of kernels
        assert got.exposed_s == pytest.approx((gather - 1e-6) + (dkv - 1e-6) + dkv)
        assert got.sent_bytes == 1024 + 2 * 2048
        assert got.comm_s == pytest.approx(gather + 2 * dkv)
        # zeros 4·(256 + 512); contiguous + cat 4096; step 0 adds (10 each); step 1 half-adds dK/dV and
        # re-concatenates (5 + 8), adds dQ (10); two fp32 cats of dK/dV (8); casts back (6 each)
        want = 4 * 768 + 4096 + 10 * 768 + (13 * REPEATED + 10 * OUT) + 2 * 8 * REPEATED + 6 * 768
        assert got.traffic_bytes == want


def test_full_recomputation_adds_the_forward_exchange():
    impl, shape = cp_impl("torch-allgather"), _shape()
    fwd, bwd = 2e-6, 5e-6
    both = impl.kind_pass(shape, COMM, B, fwd + bwd, fwd, True)
    alone = impl.kind_pass(shape, COMM, B, bwd, fwd, False)
    again = impl.kind_pass(shape, COMM, F, fwd, fwd, False)
    assert both.exposed_s == pytest.approx(alone.exposed_s + again.exposed_s)
    assert both.traffic_bytes == alone.traffic_bytes + again.traffic_bytes
    assert impl.kind_pass(shape, COMM, W, 1.0, 1.0, True).seconds(1.0) == 0.0


def test_llama3_gathers_gqa_kv_exposed():
    impl = cp_impl("llama3-allgather")
    block = GQA * 2  # 512 bytes: the g key/value heads only
    fwd = impl.kind_pass(_shape(), COMM, F, 1.0, 1.0, False)  # a long attention hides nothing
    assert (fwd.sent_bytes, fwd.exposed_s, fwd.traffic_bytes) == (block, 2 * block / GB, 0.0)
    assert fwd.kernel_calls is None and fwd.buffer_bytes == 2 * block
    bwd = impl.kind_pass(_shape(), COMM, I, 1.0, 0.5, False)
    assert (bwd.sent_bytes, bwd.exposed_s) == (block, 2 * block / GB)


def test_transformer_engine_ring_is_the_previous_pricing():
    ring = cp_impl("transformer-engine")
    fwd = ring.kind_pass(_shape(), COMM, F, 0.0, 0.0, True)
    bwd = ring.kind_pass(_shape(), COMM, I, 0.0, 0.0, True)
    assert (fwd.sent_bytes, bwd.sent_bytes) == (GQA * 2, 2 * GQA * 2)
    assert fwd.exposed_s == pytest.approx(2 * GQA * 2 / GB)  # nothing to hide behind
    assert ring.kind_pass(_shape(), COMM, F, 1.0, 1.0, True).exposed_s == 0.0


def test_the_cost_model_adds_the_implementation_per_layer():
    kw = dict(spec=SPEC, gpu="h100-sxm", cp=2, attention="flash", recompute="full", kernels="eager")
    base = TransformerCost(**kw)
    torch = TransformerCost(**kw, cp_comm="torch-alltoall")
    from pipewright.schedules import build_schedule

    sched = build_schedule("1f1b", 1, 1)
    chunk = torch._chunk(0, sched)
    acc = torch.topology.accelerator(torch.comm.device(0))
    per = acc.peak("bf16") * torch.efficiency.attention_rate * chunk.layers
    fwd = chunk.attention[F] / per
    for kind in (F, I):
        attn = chunk.attention[kind] / per
        extra = cp_layer_seconds(torch, kind, 0, attn, fwd, acc.memory_bandwidth)
        extra -= cp_layer_seconds(base, kind, 0, attn, fwd, acc.memory_bandwidth)
        got = torch.kind_time(chunk, kind, 0) - base.kind_time(base._chunk(0, sched), kind, 0)
        assert extra > 0 and got == pytest.approx(chunk.layers * extra, rel=1e-9)


def test_unknown_implementation_is_one_line():
    with pytest.raises(
        ConfigError, match=r"unknown --cp-comm 'ulysses'; choose one of: transformer-engine"
    ) as exc:
        TransformerCost(spec=SPEC, cp=2, cp_comm="ulysses")
    assert "\n" not in str(exc.value) and "llama3-allgather" in str(exc.value)


def test_defaults_per_framework_and_flag_choices():
    assert cp_impls.names() == typing.get_args(CpComm)
    assert frameworks.framework("torchtitan").defaults["cp_comm"] == "torch-allgather"
    assert "cp_comm" not in frameworks.framework("megatron").defaults
    assert TransformerCost(spec=SPEC).cp_comm == "transformer-engine"

    def parse(argv: list[str]) -> str | None:
        spec = _parser((), "simulate").parse_args(["simulate", *argv]).spec
        return with_framework_defaults(spec).framework.cp_comm

    assert parse(["--framework", "torchtitan"]) == "torch-allgather"
    assert parse(["--cp-comm", "torch-alltoall", "--framework", "torchtitan"]) == "torch-alltoall"
    assert parse([]) is None


def test_published_rows_name_their_implementation():
    assert published_spec("llama3-405b-16384gpu-cp16").framework.cp_comm == "llama3-allgather"
    titan = published_spec("tt24-8b-8gpu-cp8-t2").framework
    assert titan.cp_comm is None and titan.name == "torchtitan"  # the framework's own
    assert published_spec("llama3-405b-16384gpu-cp1").framework.cp_comm is None


def test_the_gathered_kv_is_held_while_the_pass_runs():
    from pipewright.ir import Action
    from pipewright.schedules import build_schedule

    sched = build_schedule("1f1b", 1, 1)
    kw = dict(spec=SPEC, gpu="h100-sxm", cp=2, attention="flash")
    ring, torch = TransformerCost(**kw), TransformerCost(**kw, cp_comm="torch-allgather")
    held = {}
    for kind in (F, B):
        act = Action(0, kind, 0)
        held[kind] = torch.transient_bytes(act, sched) - ring.transient_bytes(act, sched)
    block = REPEATED * 2  # bytes of one rank's repeated K/V
    assert held == {F: 2 * block, B: 2 * block + 2 * REPEATED * 4}  # + the fp32 dK/dV sent and received
