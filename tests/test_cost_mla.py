"""Multi-head latent attention, multi-token prediction and the context-parallel ring's bytes in the cost
model: DeepSeek-V3's published counts, the I/W split, exact byte counts against the runtime's ring."""

from dataclasses import replace

import pytest

from pipewright.cost.attention_kinds import ATTENTION_KINDS, attention_of, gemm_flops
from pipewright.cost.context_parallel import ring_bytes_per_layer
from pipewright.cost.layer import attention_flops, layer_parameters, layer_stored_units
from pipewright.cost.llama import cost_class
from pipewright.cost.mla import DEEPSEEK_V3_MLA, LatentAttention
from pipewright.cost.moe import moe_model_parameters
from pipewright.cost.moe_cost import moe_of
from pipewright.cost.mtp import MultiTokenPrediction
from pipewright.cost.sharding import GRAD_DTYPE_BYTES, tp_step_bytes
from pipewright.cost.tp_overlap import chunk_pass, modes, pass_exposed
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F, I, W
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.models.spec import ModelSpec
from pipewright.schedules import build_schedule

DSV3 = resolve_model("deepseek-v3")
#: a small spec with DeepSeek's attention: 16 heads of (128 + 64 | 128) over hidden 1024
SMALL = ModelSpec(
    "mla-small", 4, 1024, 16, 512, 64, ffn_hidden=2048, family="llama", attention_kind="mla"
)  # fmt: skip
SCHED = build_schedule("1f1b", 2, 4)


def _cost(spec, **kw):
    kw.setdefault("gpu", "h100-sxm")
    kw.setdefault("mesh", Mesh(pp=2))
    kw.setdefault("attention", "flash")
    return cost_class(spec)(spec, **kw)


def test_deepseek_v3_parameters_are_the_published_671b_and_37b():
    """DeepSeek-V3 technical report: 671 B total parameters, 37 B activated per token (without the
    multi-token-prediction module); MLA is 187,107,328 parameters per layer."""
    mla = attention_of(DSV3)
    assert mla is DEEPSEEK_V3_MLA
    assert mla.parameters(DSV3) == 187_107_328
    moe = moe_of(DSV3)
    assert moe_model_parameters(DSV3, moe) == pytest.approx(671e9, rel=1e-3)
    assert moe_model_parameters(DSV3, moe, activated=True) == pytest.approx(37e9, rel=0.02)


def test_mla_gemms_flops_and_core_are_its_projections():
    h, a, t, tokens = 7168, 128, 4, 10.0
    gemms = attention_of(DSV3).gemms(DSV3, tokens, t)
    assert gemms == (
        (tokens, 1536, h),  # query down, replicated over t
        (tokens, a * 192 / t, 1536),  # query up, column-parallel
        (tokens, 512 + 64, h),  # key/value latent and the shared rotary key
        (tokens, a * 256 / t, 512),  # key/value up
        (tokens, h, a * 128 / t),  # output, row-parallel
    )
    # whole-layer GEMM FLOPs per token are twice the weights (the two latent norm gains are not GEMMs)
    assert gemm_flops(attention_of(DSV3).gemms(DSV3, 1.0)) == 2 * (187_107_328 - 1536 - 512)
    # core: QK over 192 and PV over 128 per head, against 4·s²·h for MHA of the same width
    assert attention_flops(DSV3, 1) / (4 * 4096**2 * h) == pytest.approx(2 * a * 320 / (4 * h))
    no_q_rank = LatentAttention(q_rank=0)  # DeepSeek-V2-Lite: queries projected from h directly
    assert no_q_rank.gemms(DSV3, tokens)[0] == (tokens, a * 192, h)
    assert no_q_rank.parameters(DSV3) == 187_107_328 - (h * 1536 + 1536 * a * 192 + 1536) + h * a * 192


def test_mla_stores_the_latents_and_recomputes_the_up_projections():
    h, a = 1024, 16
    kept = (2 + 2 + 2 * (1536 + 512 + 64) / h, 2 * a * 128 / h)
    assert attention_of(SMALL).stored_units(SMALL) == pytest.approx(kept)
    mlp = 4 + 6 * 2048 / h  # norm and MLP inputs, SwiGLU's three intermediate tensors
    assert layer_stored_units(SMALL, scores=False) == pytest.approx(sum(kept) + mlp)
    full = LatentAttention(recompute_up=False)
    assert full.stored_units(SMALL)[1] == pytest.approx(kept[1] + 2 * a * (2 * 192 + 128) / h)
    assert full.recomputed_gemms(SMALL, 8.0) == ()
    ups = ((8.0, a * 192 / 2, 1536), (8.0, a * 256 / 2, 512))
    assert attention_of(SMALL).recomputed_gemms(SMALL, 8.0, 2) == ups


def test_the_backward_splits_mla_as_dense_layers_and_pays_the_up_projections_again():
    cost = _cost(SMALL)
    b, s = 1, SMALL.seq_len
    per_layer_linear = gemm_flops(attention_of(SMALL).gemms(SMALL, b * s)) + 2 * b * s * 3 * 1024 * 2048
    redo = gemm_flops(attention_of(SMALL).recomputed_gemms(SMALL, b * s))
    attn = attention_flops(SMALL, b)
    layers = SMALL.layers // 2  # chunk 1 of 1F1B over 2 stages holds layers 2, 3 and the output layer
    logit = 2 * b * s * 1024 * SMALL.vocab
    model = {kind: cost.model_flops(Action(1, kind, 0), SCHED) for kind in (F, I, W)}
    assert model[W] == pytest.approx(layers * per_layer_linear + logit)
    assert model[I] == pytest.approx(layers * (per_layer_linear + 2 * attn) + logit)
    executed = cost.flops(Action(1, I, 0), SCHED)
    assert executed - model[I] == pytest.approx(layers * (redo + attn / 2))  # + flash's Q·Kᵀ
    assert cost.flops(Action(1, B, 0), SCHED) == pytest.approx(executed + model[W])
    assert layer_parameters(SMALL) == attention_of(SMALL).parameters(SMALL) + 3 * 1024 * 2048 + 2 * 1024


def test_mtp_adds_one_layer_a_projection_and_a_second_output_layer_to_the_last_chunk():
    with_mtp = replace(SMALL, name="mtp", mtp_depth=1)
    a, m = _cost(SMALL), _cost(with_mtp)
    assert isinstance(m, MultiTokenPrediction) and not isinstance(a, MultiTokenPrediction)
    b, s, h, V = 1, SMALL.seq_len, SMALL.hidden, SMALL.vocab
    assert m.parameters(SCHED) - a.parameters(SCHED) == layer_parameters(SMALL) + 2 * h * h + 3 * h
    extra = 2 * b * s * h * (V + 2 * h)  # output layer and projection, each of F, I and W
    one_layer = _cost(SMALL).chunk_costs(1, (0, 1, 0))  # one plain layer's terms
    for kind in (F, I, W):
        first = Action(0, kind, 0)
        assert m.model_flops(first, SCHED) == a.model_flops(first, SCHED)
        delta = m.model_flops(Action(1, kind, 0), SCHED) - a.model_flops(Action(1, kind, 0), SCHED)
        assert delta == pytest.approx(one_layer.model_flops[kind] + extra)
    stored = m.activation_bytes(Action(1, F, 0), SCHED) - a.activation_bytes(Action(1, F, 0), SCHED)
    assert stored == pytest.approx(one_layer.memory[F] + 8 * s * b * h + 4 * b * s * V)


def test_mtp_tensor_parallel_collectives_are_megatron_cores_and_re_gather_as_the_head():
    """Megatron-Core's ``MultiTokenPredictionLayer`` at tp 2, per microbatch (all-reduce bytes; a
    gather or scatter of B bytes is B/2): without sequence parallelism the embedding's all-reduce and
    the gather of the projection's output columns in F, the projection's [s, b, 2h] input-gradient
    all-reduce and the output layer's in I; with it, the embedding's reduce-scatter, the projection's
    input all-gather and the output columns' gather in F, then in I the projection's and the output
    layer's re-gathers after the head's, hidden behind their input-gradient GEMMs as the head's is,
    and the embedding's gather, the projection's reduce-scatter, the sequence scatter's gather and the
    output layer's input gradient; the block is one more layer, its 3 norms join the step."""
    with_mtp = replace(SMALL, name="mtp", mtp_depth=1)
    act, loss = SMALL.seq_len * SMALL.hidden * 2, 4.0 * SMALL.seq_len  # b = 1, bf16
    for sp in (False, True):
        kw = {"mesh": Mesh(tp=2, pp=2), "sequence_parallel": sp}
        a, m = _cost(SMALL, **kw), _cost(with_mtp, **kw)
        plain, chunk = a._chunk(1, SCHED), m._chunk(1, SCHED)
        n = chunk.layers
        assert n == plain.layers + 1
        layers, head = (act,) * 2 * n, (loss,) * 3
        if sp:
            fwd, regathers, bwd = (act / 2, act, act / 2, *head), (act, act / 2), (act / 2, act, act / 2, act)
            main_regathers = (act / 2,) * (2 * n + 1)
        else:
            fwd, regathers, bwd, main_regathers = (act, act / 2, *head), (), (2 * act, act), ()
        assert chunk.tp_bytes[F] == layers + head + fwd
        assert chunk.tp_bytes[I] == layers + main_regathers + regathers + (act,) + bwd
        p = chunk_pass(m, chunk, I, 1, 1e-3)
        start, stop = p.regathers()
        assert chunk.tp_bytes[I][start:stop] == (main_regathers + regathers if sp else ())
        acc = m.topology.accelerator(m.comm.device(1))
        proj = m.gemm_time([(SMALL.seq_len, 2 * SMALL.hidden, SMALL.hidden / 2, 1)], acc)
        assert [d() for d in p.mtp] == [proj, p.head()]
        for comm in (1e-10, 10.0):
            every = (comm,) * len(chunk.tp_bytes[I])
            q = chunk_pass(m, chunk, I, 1, 1e-3, every)
            dgrads = [d for _, _, d in q.blocks()] * n + [q.head(), proj, q.head()]
            hidden = sum(max(0.0, comm - d) for d in dgrads) if sp else 0.0
            assert pass_exposed(modes()["none"], q) == pytest.approx(
                (len(every) - (stop - start)) * comm + hidden
            )
        grad = GRAD_DTYPE_BYTES[m.grad_dtype]
        added = sum(tp_step_bytes(m, 1, SCHED)) - sum(tp_step_bytes(a, 1, SCHED))
        assert added == (5 * SMALL.hidden * grad if sp else 0)  # the block's 2 norms + the module's 3


def test_deepseek_v3_mtp_block_is_a_moe_layer_on_the_last_chunk():
    cost = _cost(DSV3, gpu="h800", mesh=Mesh(pp=2, dp=8, ep=8))
    sched = build_schedule("1f1b", 2, 4)
    last = cost._chunk(1, sched)
    assert last.layers == 31 and last.moe_layers == 31  # 30 of the 61 layers + the MTP block
    assert cost._chunk(0, sched).moe_layers == 31 - 3  # the first 3 layers are dense


def test_ring_backward_bytes_as_transformer_engine_and_as_the_runtime_send_them():
    spec, b, cp, t, e = DSV3, 2, 4, 2, 2
    block = b * (spec.seq_len / cp) * 128 * (192 + 128) / t  # MLA's up-projected K and V
    te = ring_bytes_per_layer(spec, b, cp, t, e)
    assert te[F] == 3 * block * e and te[I] == te[B] == 2 * te[F] and te[W] == 0
    ours = ring_bytes_per_layer(spec, b, cp, t, e, ring="pipewright")
    assert ours[I] == 3 * block * e + 3 * block * 4  # K/V in bf16, the fp32 dK/dV c − 1 times
    with pytest.raises(ConfigError, match="unknown ring") as info:
        ring_bytes_per_layer(spec, b, cp, t, e, ring="ulysses")
    assert "\n" not in str(info.value)


def test_the_runtime_ring_sends_what_the_pipewright_ring_is_priced_at():
    torch = pytest.importorskip("torch")
    from pipewright.runtime.parallel.cp.ring import RingAttention

    class Recording:  # one rank of a ring of `size`, counting the bytes it would send
        rank, size = 1, 3

        def __init__(self):
            self.sent = {False: 0, True: 0}

        def exchange(self, tensor, backward=False):
            self.sent[backward] += tensor.numel() * tensor.element_size()
            return type("Done", (), {"wait": lambda _self: tensor.clone()})()

    spec = ModelSpec("ring", 1, 32, 4, 16, 12, family="llama", kv_heads=2)
    ring, b, n = Recording(), 2, spec.seq_len // Recording.size
    q = torch.randn(b, 4, n, 8, requires_grad=True)
    k, v = (torch.randn(b, 2, n, 8, requires_grad=True) for _ in range(2))
    RingAttention.apply(q, k, v, ring).sum().backward()
    want = ring_bytes_per_layer(spec, b, ring.size, 1, 4, ring="pipewright")
    assert (ring.sent[False], ring.sent[True]) == (want[F], want[I])


def test_unknown_attention_kind_and_negative_mtp_depth_are_one_line_errors():
    with pytest.raises(ConfigError, match="unknown attention kind 'gqa2'; choose one of: mha, mla") as info:
        attention_of(replace(SMALL, attention_kind="gqa2"))
    assert "\n" not in str(info.value) and set(ATTENTION_KINDS) == {"mha", "mla"}
    with pytest.raises(ConfigError, match="--mtp-depth must be between 0 and --layers 4") as info:
        replace(SMALL, mtp_depth=-1)
    assert "\n" not in str(info.value)


def test_simulate_takes_the_attention_kind_and_the_mtp_depth(capsys):
    import contextlib
    import io
    import json
    import typing

    from pipewright.cli import main
    from pipewright.runspec.choices import AttentionKind

    assert tuple(ATTENTION_KINDS) == typing.get_args(AttentionKind)
    argv = ["simulate", "--model", "llama-moe-tiny", "--gpu", "h100-sxm", "--gpus-per-node", "2", "--pp", "2"]
    argv += ["--schedule", "1f1b", "--global-batch-size", "4", "--json"]
    flops = {}
    for extra in ((), ("--attention-kind", "mla"), ("--attention-kind", "mla", "--mtp-depth", "1")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, *extra]) == 0
        flops[extra] = json.loads(out.getvalue())["model_flops_per_iteration"]
    assert (
        flops[()]
        < flops[("--attention-kind", "mla")]
        < flops[("--attention-kind", "mla", "--mtp-depth", "1")]
    )
    assert main([*argv, "--mtp-depth", "5"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--mtp-depth must be between 0 and --layers 4 (got 5)" in err and "\n" not in err


def test_the_runtime_builds_multi_head_attention_and_no_mtp_module_from_the_same_preset():
    from pipewright.runtime.setup.config import TrainConfig

    built = TrainConfig(model="deepseek-v3").model_spec()
    assert (built.attention_kind, built.mtp_depth) == ("mha", 0)
    assert (DSV3.attention_kind, DSV3.mtp_depth) == ("mla", 1)
    assert replace(built, attention_kind="mla", mtp_depth=1) == replace(DSV3, name=built.name)
