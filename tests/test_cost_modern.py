"""The cost model on today's runs: flash attention, Llama memory, the I/W split, sharded optimizer
state, context parallelism, fp8, GEMM wave quantisation, calibration files and memory by parts."""

import contextlib
import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipewright.cli import main
from pipewright.cost.calibration import load_calibration
from pipewright.cost.gemm import wave_efficiency
from pipewright.cost.kernels import eager_layer_bytes
from pipewright.cost.layer import kv_width, layer_linear_flops
from pipewright.cost.llama import LlamaCost
from pipewright.cost.recompute import make_cost
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F, I, W
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.schedules import build_schedule

LLAMA = resolve_model("llama3-8b")
GPT = resolve_model("gpt3-xl")
SCHED = build_schedule("1f1b", 2, 4)


def _cli(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json", "--allow-no-fit"]) == 0  # the report, whether or not it fits
    return json.loads(out.getvalue())


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_llama_flash_memory_is_positive_and_sequence_parallel_divides_it(sp, recompute):
    t = 4
    kw = dict(mesh=Mesh(tp=t, pp=2), sequence_parallel=sp, recompute=recompute, attention="flash")
    cost = LlamaCost(LLAMA, **kw)
    per_layer = cost.layer_stored_bytes()
    assert per_layer > 0
    s, h = LLAMA.seq_len, LLAMA.hidden
    if recompute == "full":
        assert per_layer == 2 * s * h / (t if sp else 1)
    elif sp:  # every part of the layer is split over t
        one = LlamaCost(LLAMA, mesh=Mesh(pp=2), recompute=recompute, attention="flash").layer_stored_bytes()
        assert per_layer == pytest.approx(one / t)
    assert cost.activation_bytes(Action(0, F, 0), SCHED) > 0


def test_selective_is_modelled_for_llama_and_equals_none_with_flash():
    eager = [make_cost(r, cls=LlamaCost, spec=LLAMA, mesh=Mesh(pp=2)) for r in ("none", "selective")]
    f = Action(0, F, 0)
    assert eager[1].activation_bytes(f, SCHED) < eager[0].activation_bytes(f, SCHED)
    flash = [LlamaCost(LLAMA, mesh=Mesh(pp=2), recompute=r, attention="flash") for r in ("none", "selective")]
    assert flash[0].activation_bytes(f, SCHED) == flash[1].activation_bytes(f, SCHED)


def test_w_is_the_weight_gradient_gemms_only():
    cost = TransformerCost(GPT, mesh=Mesh(pp=2), attention="flash")
    layers = GPT.layers // 2
    w = cost.flops(Action(0, W, 0), SCHED)
    assert w == pytest.approx(layers * layer_linear_flops(GPT, 1))
    assert cost.flops(Action(0, I, 0), SCHED) + w == pytest.approx(cost.flops(Action(0, B, 0), SCHED))
    times = {k: cost.compute_time(Action(0, k, 0), SCHED) for k in (F, I, W)}
    assert times[W] < times[F] < times[I]  # attention backward and memory-bound kernels sit in I


def test_optimizer_sharding_memory():
    kw = dict(spec=GPT, mesh=Mesh(pp=2, dp=8), gpu="h100-sxm")
    none, zero1, fsdp = (TransformerCost(optimizer_sharding=m, **kw) for m in ("none", "zero1", "fsdp"))
    params = sum(none._chunk(c, SCHED).params for c in SCHED.stages_of(0))
    assert none.static_bytes(0, SCHED) == pytest.approx(18 * params)
    assert zero1.static_bytes(0, SCHED) == pytest.approx((6 + 12 / 8) * params)
    assert fsdp.static_bytes(0, SCHED) == pytest.approx((2 + 16 / 8) * params)  # pipelined: kept gathered
    assert fsdp.message_bytes(Action(0, "REDUCE_GRAD", 0), SCHED) > 0  # once per step
    one = build_schedule("1f1b", 1, 4)
    flat = TransformerCost(spec=GPT, mesh=Mesh(dp=8), gpu="h100-sxm", optimizer_sharding="fsdp")
    params = flat._chunk(0, one).params
    assert flat.static_bytes(0, one) == pytest.approx(18 / 8 * params + flat.gather_buffer_bytes())
    assert flat.message_bytes(Action(0, "REDUCE_GRAD", 0), one) == 0  # reduce-scattered per layer
    with pytest.raises(ConfigError, match="optimizer sharding must be one of"):
        TransformerCost(optimizer_sharding="zero2", **kw)


def test_context_parallel_divides_work_and_memory_and_checks_the_sequence():
    kw = dict(mesh=Mesh(pp=2), gpu="h100-sxm", attention="flash")
    one, four = LlamaCost(LLAMA, **kw), LlamaCost(LLAMA, cp=4, **kw)
    f = Action(0, F, 0)
    assert four.flops(f, SCHED) == pytest.approx(one.flops(f, SCHED) / 4)
    assert four.activation_bytes(f, SCHED) == pytest.approx(one.activation_bytes(f, SCHED) / 4)
    assert four.mesh.size == 8 and four.mesh.order == "tp-cp-dp-pp"
    with pytest.raises(ConfigError, match="divisible by 2 × cp = 6"):
        LlamaCost(LLAMA, cp=3, **kw)


def test_fp8_speeds_up_the_gemms_only_and_keeps_fp8_gemm_inputs():
    kw = dict(mesh=Mesh(pp=2), gpu="h100-sxm", attention="flash")
    bf16, fp8 = LlamaCost(LLAMA, dtype="bf16", **kw), LlamaCost(LLAMA, dtype="fp8", **kw)
    f = Action(0, F, 0)
    ratio = bf16.compute_time(f, SCHED) / fp8.compute_time(f, SCHED)
    assert 1.2 < ratio < 2.0
    saved = bf16.activation_bytes(f, SCHED) - fp8.activation_bytes(f, SCHED)  # FP8 copies of GEMM inputs
    s, h, ff = LLAMA.seq_len, LLAMA.hidden, LLAMA.ffn_hidden
    # QKV, MLP and down-projection inputs: 1 byte instead of 2; the output projection's FP8 copy is
    # kept besides the attention output the fused kernel keeps in 16 bits (1 byte more)
    assert saved == pytest.approx(LLAMA.layers // 2 * s * h * (1 + 1 - 1 + ff / h))


@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 200))
def test_wave_efficiency_is_a_fraction_and_one_for_full_waves(m, n, sms):
    e = wave_efficiency(m, n, sms)
    assert 0 < e <= 1
    assert wave_efficiency(128 * sms, 128, sms) == 1.0


def _calibration(tmp_path, **over):
    data = {
        "format": "pipewright-calibration/1",
        "accelerator": "h100-sxm",
        "device_name": "NVIDIA H100 80GB HBM3",
        "dtype": "bf16",
        "measured_at": "2026-11-25",
        "torch": "2.13.0",
        "gemm": [
            {"m": 1024, "n": 1024, "k": 1024, "dtype": "bf16", "seconds": 1e-5, "tflops": 214.7},
            {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "seconds": 1.6e-3, "tflops": 687.2},
        ],
        "memory_bandwidth": 2.9e12,
        "links": {"intra_node": {"bandwidth": 3.6e11, "latency": 3e-6}},
    }
    data.update(over)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def test_calibration_interpolates_and_prices_gemms(tmp_path):
    cal = load_calibration(_calibration(tmp_path), "h100-sxm")
    assert cal.gemm_flops_per_second(8192, 8192, 8192) == pytest.approx(687.2e12)
    mid = cal.gemm_flops_per_second(2896, 2896, 2896)
    assert 214.7e12 < mid < 687.2e12
    assert cal.gemm_flops_per_second(64, 64, 64) == pytest.approx(214.7e12)  # below the range
    kw = dict(mesh=Mesh(pp=2), gpu="h100-sxm", attention="flash")
    slow = LlamaCost(LLAMA, calibration=cal, **kw)
    assert slow.compute_time(Action(0, W, 0), SCHED) > 0


@pytest.mark.parametrize(
    "over, gpu, message",
    [
        ({}, "a100-80gb", "was measured on 'h100-sxm', not on --gpu a100-80gb"),
        ({"format": "other/2"}, "h100-sxm", "format must be 'pipewright-calibration/1'"),
        ({"memory_bandwidth": None}, "h100-sxm", "missing field"),
        ({"gemm": []}, "h100-sxm", "non-empty list"),
    ],
)
def test_bad_calibration_is_one_line(tmp_path, over, gpu, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_calibration(_calibration(tmp_path, **over), gpu)
    assert "\n" not in str(err.value)


BASE = ["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--nodes", "1", "--tp", "2", "--pp", "4"]
BASE += ["--schedule", "1f1b", "--microbatch-size", "1", "--global-batch-size", "8"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layout", "E|t*8|t*8|t*8L"], "layout"),
        (["--cp", "3", "--pp", "1", "--nodes", "1", "--gpus-per-node", "6"], "divisible by 2 × cp"),
    ],
)
def test_bad_simulate_input_is_one_line(extra, message, capsys):
    assert main([*BASE, *extra]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_simulate_flags_reach_the_model_and_memory_parts(tmp_path):
    report = _cli([*BASE, "--shard-optimizer", "--sequence-parallel", "--tp-comm-overlap"])
    parts = report["per_rank"][0]["memory_parts"]
    assert set(parts) >= {"weights", "gradients", "optimizer_state", "activations", "allocator_reserve"}
    static_and_act = sum(v for k, v in parts.items() if k not in ("total", "allocator_reserve"))
    assert static_and_act - parts["communication_buffers"] == pytest.approx(
        report["per_rank"][0]["peak_memory_bytes"], rel=1e-9
    )
    fsdp = _cli([*BASE, "--fsdp"])["per_rank"][0]["memory_parts"]
    assert fsdp["optimizer_state"] == pytest.approx(parts["optimizer_state"])  # dp = 1: nothing to shard
    uneven = _cli([*BASE, "--layout", "E|t*11|t*11|t*10L"])
    busy = [r["busy_s"] for r in uneven["per_rank"]]
    assert busy[0] < busy[1] / 100  # an embedding-only first stage
    eager = _cli([*BASE, "--attention", "eager"])
    assert eager["iteration_time_s"] > report["iteration_time_s"]


def test_mlp_and_bias_flags_shape_a_custom_model(capsys):
    argv = ["simulate", "--model", "gpt", "--layers", "4", "--hidden", "1024", "--heads", "16"]
    argv += ["--vocab", "32000", "--seq-len", "2048", "--gpu", "h100-sxm", "--pp", "2", "--nodes", "1"]
    argv += ["--gpus-per-node", "2", "--schedule", "1f1b", "--global-batch-size", "4"]
    gelu = _cli(argv)
    swiglu = _cli([*argv, "--mlp", "swiglu", "--no-bias"])
    assert swiglu["iteration_time_s"] > gelu["iteration_time_s"]  # three MLP matrices instead of two
    assert main([*argv, "--kv-heads", "4"]) == 2
    assert "needs --model llama" in capsys.readouterr().err
    llama = ["--model", "llama", *argv[3:], "--kv-heads", "4", "--mlp", "gelu"]
    assert _cli(["simulate", *llama])["iteration_time_s"] < gelu["iteration_time_s"]  # fewer K/V FLOPs


def test_bf16_gradient_buffers_take_two_bytes_per_parameter():
    kw = dict(spec=GPT, mesh=Mesh(pp=2, dp=8), gpu="h100-sxm", optimizer_sharding="zero1")
    fp32, bf16 = (TransformerCost(grad_dtype=g, **kw) for g in ("fp32", "bf16"))
    params = sum(fp32._chunk(c, SCHED).params for c in SCHED.stages_of(0))
    assert fp32.static_bytes(0, SCHED) - bf16.static_bytes(0, SCHED) == pytest.approx(2 * params)
    assert (bf16.state().gradients, bf16.state().optimizer) == pytest.approx((2, 12 / 8))
    f = Action(0, F, 0)
    assert bf16.compute_time(f, SCHED) == fp32.compute_time(f, SCHED)  # memory only
    with pytest.raises(ConfigError, match="--grad-dtype must be one of fp32, bf16"):
        TransformerCost(grad_dtype="fp16", **kw)
    grads = [
        _cli([*BASE, *g])["per_rank"][0]["memory_parts"]["gradients"] for g in ([], ["--grad-dtype", "bf16"])
    ]
    assert grads[1] == pytest.approx(grads[0] / 2)


def test_op_recompute_keeps_what_torchtitans_policy_saves_and_reruns_the_rest():
    """torchtitan's "op" policy: the block input, q, v, w1, w2 (1st, 3rd, 5th, 7th matmul) and the
    SDPA output (+ fp32 log-sum-exp) kept; k, o, w3 and the memory-bound forward re-run in I."""
    kw = dict(spec=LLAMA, mesh=Mesh(pp=2), gpu="h100-sxm", attention="flash")
    none, op, full = (make_cost(m, **kw) for m in ("none", "op", "full"))
    s, h, f, kv = LLAMA.seq_len, LLAMA.hidden, LLAMA.ffn_hidden, kv_width(LLAMA)
    kept = s * (2 * (h + h + kv + f + h + h) + 4 * LLAMA.heads)
    layers, f0, i0 = LLAMA.layers // 2, Action(0, F, 0), Action(0, I, 0)
    more = op.activation_bytes(f0, SCHED) - none.activation_bytes(f0, SCHED)
    assert more == pytest.approx(layers * (kept - none.layer_stored_bytes()))
    assert (
        full.activation_bytes(f0, SCHED) < op.activation_bytes(f0, SCHED) < none.activation_bytes(f0, SCHED)
    )
    assert op.flops(i0, SCHED) - none.flops(i0, SCHED) == pytest.approx(layers * 2 * s * h * (kv + h + f))
    assert op.model_flops(i0, SCHED) == none.model_flops(i0, SCHED)
    assert none.compute_time(i0, SCHED) < op.compute_time(i0, SCHED) < full.compute_time(i0, SCHED)
    assert _cli([*BASE, "--recompute", "op"])["iteration_time_s"] > _cli(BASE)["iteration_time_s"]
    with pytest.raises(ConfigError, match="dense layers only"):
        make_cost("op", spec=resolve_model("mixtral-8x7b"), mesh=Mesh(pp=2), gpu="h100-sxm")
    with pytest.raises(ConfigError, match="needs --attention flash"):
        make_cost("op", spec=LLAMA, mesh=Mesh(pp=2), gpu="h100-sxm", attention="eager")


def test_eager_kernels_move_the_bytes_of_pytorchs_decomposition():
    h, f, kv = LLAMA.hidden, LLAMA.ffn_hidden, kv_width(LLAMA)
    common = 20 * (h + kv) + 2 * (2 * kv + 2 * h) + 4 * h + 12 * h  # rotary, repeat_kv, contiguous, adds
    assert eager_layer_bytes(LLAMA) == pytest.approx((72 * h + 10 * f + common, 184 * h + 18 * f + common))
    kw = dict(spec=LLAMA, mesh=Mesh(pp=2), gpu="h100-sxm", attention="flash")
    fused, eager, compiled = (TransformerCost(kernels=k, **kw) for k in ("fused", "eager", "compiled"))
    layers, s = LLAMA.layers // 2, LLAMA.seq_len
    assert eager._chunk(0, SCHED).traffic[F] == pytest.approx(layers * s * eager_layer_bytes(LLAMA)[0])
    assert compiled._chunk(0, SCHED).traffic == fused._chunk(0, SCHED).traffic  # fused blocks
    last = Action(1, F, 0)  # the loss: three fp32 logit tensors at the eager backward's peak, not one
    gap = eager.activation_bytes(last, SCHED) - fused.activation_bytes(last, SCHED)
    assert gap == pytest.approx(8 * s * LLAMA.vocab)
    assert compiled.activation_bytes(last, SCHED) == pytest.approx(eager.activation_bytes(last, SCHED))
    assert (
        fused.compute_time(last, SCHED) < compiled.compute_time(last, SCHED) < eager.compute_time(last, SCHED)
    )
    with pytest.raises(ConfigError, match="--kernels must be one of fused, eager, compiled"):
        TransformerCost(kernels="triton", **kw)
    times = [_cli([*BASE, "--kernels", k])["iteration_time_s"] for k in ("fused", "eager")]
    assert times[1] > times[0]


def test_pipelined_fsdp_holds_unsharded_gradients_until_the_step_when_it_syncs_once():
    kw = dict(spec=GPT, mesh=Mesh(pp=2, dp=8), gpu="h100-sxm", optimizer_sharding="fsdp")
    micro, step = (TransformerCost(fsdp_grad_sync=g, **kw) for g in ("microbatch", "step"))
    params = sum(micro._chunk(c, SCHED).params for c in SCHED.stages_of(0))
    assert step.static_bytes(0, SCHED) - micro.static_bytes(0, SCHED) == pytest.approx((4 - 4 / 8) * params)
    bf16 = TransformerCost(fsdp_grad_sync="step", grad_dtype="bf16", **kw)
    assert bf16.state().gradients == 2
    one = build_schedule("1f1b", 1, 4)  # without pipelining FSDP reduce-scatters per layer: no change
    flat = [
        TransformerCost(
            spec=GPT, mesh=Mesh(dp=8), gpu="h100-sxm", optimizer_sharding="fsdp", fsdp_grad_sync=g
        )
        for g in ("microbatch", "step")
    ]
    assert flat[0].static_bytes(0, one) == flat[1].static_bytes(0, one)
    with pytest.raises(ConfigError, match="--fsdp-grad-sync must be one of microbatch, step"):
        TransformerCost(fsdp_grad_sync="never", **kw).state()
