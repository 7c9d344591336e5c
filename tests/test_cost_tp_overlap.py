"""Tensor-parallel overlap modes (cost/tp_overlap.py) and the data-parallel reduction's bytes
(cost/sharding.reduction_bytes): exact values from the formulas the modules state."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pipewright.cli import main
from pipewright.cost import Mesh, TransformerCost
from pipewright.cost.layer import layer_gemms
from pipewright.cost.sharding import reduction_bytes
from pipewright.cost.tp_overlap import TpPass, chunk_pass, modes, pass_exposed, resolve
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.runspec.run_sections import FrameworkSection
from pipewright.schedules.registry import build_schedule

SPEC = ModelSpec("t", layers=4, hidden=256, heads=8, vocab=1000, seq_len=128, mlp="swiglu", ffn_hidden=512)


def test_the_flag_names_the_registered_modes():
    help = FrameworkSection.__dataclass_fields__["tp_comm_overlap"].metadata["help"]
    assert f"(MODE: {', '.join(modes())})" in help  # the flag's help names every registered mode
    assert resolve(True) == "te" and resolve(False) == "none" and resolve("async-tp") == "async-tp"
    with pytest.raises(
        ConfigError, match=r"^--tp-comm-overlap must be one of none, te, async-tp \(got 'x'\)$"
    ):
        TransformerCost(SPEC, mesh=Mesh(tp=2), tp_comm_overlap="x")


def _exposed(
    mode: str, kind: str, recompute: str = "none", comm: float = 10.0
) -> tuple[float, float, int, int]:
    """(exposed seconds, seconds of the layer GEMMs that may hide them, layers, collectives) of
    stage 0's ``kind`` with every collective lasting ``comm`` seconds (so each exceeds any matmul)."""
    cost = TransformerCost(
        SPEC, mesh=Mesh(tp=4), sequence_parallel=True, tp_comm_overlap=mode, recompute=recompute
    )
    schedule = build_schedule("1f1b", 1, 1)
    chunk = cost._chunk(0, schedule)
    acc = cost.topology.accelerator(cost.comm.device(0))
    gemms = layer_gemms(SPEC, 128, 4)
    fwd = sum(cost.gemm_time([(m, n, k, 1)], acc) for m, n, k in gemms)
    bwd = sum(cost.gemm_time([(m, k, n, 1)], acc) for m, n, k in (gemms[1], gemms[3]))  # the fused dgrads
    collectives = (comm,) * len(chunk.tp_bytes[kind])
    exposed = modes()[mode].exposed_time(chunk_pass(cost, chunk, kind, 0, 1e-3, collectives))
    return exposed, (fwd if kind == F else bwd), chunk.layers, len(collectives)


def test_async_tp_hides_one_piece_less_than_each_fused_matmul():
    """Every collective longer than its matmul: a fused one leaves C/2 − M·(t − 1)/t, an unfused one C/2;
    the forward fuses all four per layer, the backward the two output-gradient all-gathers."""
    share = 3 / 4
    got, hidden, n, count = _exposed("async-tp", F)
    assert got == pytest.approx(count * 10.0 - n * share * hidden, rel=1e-12)
    for kind in (I, B):
        got, hidden, n, count = _exposed("async-tp", kind)
        assert got == pytest.approx(count * 10.0 - n * share * hidden, rel=1e-12)
    got, hidden, n, count = _exposed("async-tp", I, "full")
    _, fwd_hidden, _, _ = _exposed("async-tp", F)
    assert got == pytest.approx(count * 10.0 - n * share * (hidden + fwd_hidden), rel=1e-12)


def test_modes_order_none_async_te():
    """te hides behind every GEMM of the pass, async-tp only behind the matmuls it fuses."""
    for kind in (F, I):
        none, te, async_tp = (_exposed(m, kind, comm=1e-4)[0] for m in ("none", "te", "async-tp"))
        assert te <= async_tp <= none
    # short collectives: every fused one hidden; the embedding's and the loss's four stay exposed,
    # and in the backward the input-gradient reduce-scatters (half of each layer collective)
    exposed, _, n, count = _exposed("async-tp", F, comm=1e-10)
    assert exposed == pytest.approx((count - 2 * n) * 1e-10, rel=1e-9)
    exposed, _, n, count = _exposed("async-tp", I, comm=1e-10)
    assert exposed == pytest.approx((count - 2 * n) * 1e-10 + 2 * n * 0.5e-10, rel=1e-9)


def test_sequence_parallel_backward_regathers_each_block_input_under_its_dgrad():
    """With sequence parallelism I holds, after the layers' all-reduces, two all-gathers of b·s·h a
    layer (½ an all-reduce each: Megatron's re-gather for the weight gradient) and the output layer's
    one, none without it; each stays exposed only by what exceeds its block's (the output layer's)
    input-gradient GEMM, in every mode."""
    schedule = build_schedule("1f1b", 1, 1)
    act = 128 * SPEC.hidden * 2
    for sp in (False, True):
        chunk = TransformerCost(SPEC, mesh=Mesh(tp=4), sequence_parallel=sp)._chunk(0, schedule)
        n = chunk.layers
        assert chunk.tp_bytes[I][2 * n : 4 * n + 1] == ((act / 2,) * (2 * n + 1) if sp else (act,))
        assert len(chunk.tp_bytes[I]) == 2 * n + (2 * n + 1) * sp + 1 and chunk.tp_bytes[W] == ()
    for mode in modes():
        cost = TransformerCost(SPEC, mesh=Mesh(tp=4), sequence_parallel=True, tp_comm_overlap=mode)
        chunk = cost._chunk(0, schedule)
        n, count = chunk.layers, len(chunk.tp_bytes[I])
        for comm in (1e-10, 10.0):
            collectives = (comm,) * count
            p = chunk_pass(cost, chunk, I, 0, 1e-3, collectives)
            rest = chunk_pass(cost, chunk, I, 0, 1e-3, collectives[: 2 * n] + collectives[4 * n + 1 :])
            dgrads = [d for _, _, d in p.blocks()] * n + [p.head()]
            gathers = sum(max(0.0, comm - d) for d in dgrads)
            assert pass_exposed(modes()[mode], p) == pytest.approx(
                modes()[mode].exposed_time(rest) + gathers, rel=1e-12
            )
            assert gathers == (0.0 if comm < 1 else pytest.approx((2 * n + 1) * comm - sum(dgrads)))


def test_a_head_only_stage_hides_its_re_gather_under_the_output_layers_input_gradient():
    """A stage of the output layer alone (no layers) under sequence parallelism: its I holds the
    re-gather (½ an all-reduce), then the input gradient's; only what exceeds the output layer's
    input-gradient GEMM (``head``) of the re-gather stays exposed, in every mode."""
    for mode in modes().values():
        for gather, dgrad in ((3.0, 1.0), (1.0, 3.0)):
            p = TpPass(I, (gather, 2.0), 10.0, 0, 4, False, tuple, True, lambda d=dgrad: d)
            assert p.regathers() == (0, 1)
            rest = TpPass(I, (2.0,), 10.0, 0, 4)
            assert pass_exposed(mode, p) == mode.exposed_time(rest) + max(0.0, gather - dgrad)


@pytest.mark.parametrize(
    ("mode", "grad_dtype", "dtype", "overlapped", "expected"),
    [
        ("none", "fp32", "bf16", False, 4.0),  # Megatron-LM: bf16 reduces the fp32 buffer
        ("none", "bf16", "bf16", False, 2.0),
        ("none", "fp32", "fp16", False, 2.0),  # fp16: accumulate_allreduce_grads_in_fp32 defaults off
        ("zero1", "fp32", "bf16", False, 3.0),  # reduce-scatter 4 + all-gather 2, in all-reduce units
        ("zero1", "fp32", "bf16", True, 2.0),  # the all-gather under the next forward
        ("zero1", "bf16", "fp8", True, 1.0),
        ("fsdp", "fp32", "bf16", True, 3.0),
    ],
)
def test_reduction_bytes(mode, grad_dtype, dtype, overlapped, expected):
    assert reduction_bytes(mode, grad_dtype, dtype, overlapped) == expected


def _simulate(flags: list[str]) -> dict:
    out = io.StringIO()
    base = "simulate --model llama3-8b --gpu h100-sxm --nodes 2 --tp 8 --pp 2 --schedule 1f1b"
    with contextlib.redirect_stdout(out):
        assert main([*base.split(), "--microbatches", "4", "--sequence-parallel", *flags, "--json"]) == 0
    return json.loads(out.getvalue())


def test_simulate_prices_async_tp_between_no_overlap_and_te():
    times = {m: _simulate(["--tp-comm-overlap", m])["iteration_time_s"] for m in ("none", "async-tp")}
    te = _simulate(["--tp-comm-overlap"])["iteration_time_s"]
    assert te < times["async-tp"] < times["none"]


@pytest.mark.parametrize(("grad_reduce", "expected"), [("after", 3.0), ("overlap", 2.0)])
def test_the_reduction_follows_where_it_runs(grad_reduce, expected):
    """The distributed optimizer with an fp32 buffer: reduce-scatter 4 + all-gather 2 bytes after the
    pipeline; with the reduction overlapped, the all-gather runs under the next forward."""
    from pipewright.plan.setup import model_setup
    from pipewright.topology import cluster

    mesh = Mesh(tp=1, pp=2, dp=4)
    setup = model_setup(
        SPEC,
        cluster(1, 8, "h100-sxm"),
        mesh,
        build_schedule("1f1b", 2, 4),
        1,
        gpu="h100-sxm",
        grad_reduce=grad_reduce,
        optimizer_sharding="zero1",
    )
    assert setup.cost.grad_bytes == expected
