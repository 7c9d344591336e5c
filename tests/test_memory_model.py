"""The memory side of the analytical cost model (cost/chunk_memory.py): stage outputs freed after the
send (Megatron, Llama 3) or kept until the backward (torch.distributed.pipelining), the embedding
dropout's mask, and the fused attention output kept besides the FP8 copies."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest

from pipewright.cli import main
from pipewright.cost.chunk_memory import deferred_grad_output_bytes, fused_output_units, output_kept_bytes
from pipewright.cost.comm import Mesh
from pipewright.cost.layer import embedding_parameters, head_parameters, layer_parameters
from pipewright.cost.recompute import make_cost
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F, I, W
from pipewright.models.layout import parse_layout
from pipewright.models.spec import ModelSpec
from pipewright.schedules import build_schedule
from pipewright.sim import engine
from pipewright.sim.engine import simulate
from pipewright.sim.memory import peak_from_deltas, peak_memory

GPT = ModelSpec("gpt", 8, 256, 8, 1000, 64)
LLAMA = ModelSpec("llama", 8, 256, 8, 1000, 64, ffn_hidden=704, family="llama", kv_heads=2, mlp="swiglu")
SBH = 64 * 256


def _cost(spec: ModelSpec, pp: int = 4, **kw) -> TransformerCost:
    return TransformerCost(spec, mesh=Mesh(tp=kw.pop("tp", 1), pp=pp), gpu="a100-80gb", **kw)


def test_a_kept_stage_output_costs_one_activation_per_microbatch_on_every_chunk_but_the_last() -> None:
    sched = build_schedule("1f1b", 4, 8)
    for tp, sp, split in ((1, False, 1), (2, False, 1), (2, True, 2)):
        freed = _cost(GPT, tp=tp, sequence_parallel=sp)
        kept = _cost(GPT, tp=tp, sequence_parallel=sp, stage_outputs="kept")
        for stage in range(4):
            diff = kept.activation_bytes(Action(stage, F, 0), sched) - freed.activation_bytes(
                Action(stage, F, 0), sched
            )
            assert diff == (0 if stage == 3 else SBH * 2 / split), (tp, sp, stage)
            assert kept.activation_bytes(Action(stage, B, 0), sched) == -kept.activation_bytes(
                Action(stage, F, 0), sched
            )


def test_deallocation_saves_p_activations_on_the_first_rank_as_korthikanti_appendix_b() -> None:
    """Korthikanti et al. 2022, Appendix B: freeing each microbatch's output saves s·b·h·p (2 bytes) on
    the first rank of 1F1B, where p microbatches are in flight (2.73 GB for their 530B at p = 35)."""
    p = 35
    sched = build_schedule("1f1b", p, 2 * p)
    spec = ModelSpec("mt-nlg", 105, 20480, 128, 51200, 2048)
    peaks = {
        mode: simulate(sched, _cost(spec, pp=p, tp=8, stage_outputs=mode)).peak_memory[0]
        for mode in ("freed", "kept")
    }
    saved = peaks["kept"] - peaks["freed"]
    assert saved == pytest.approx(2048 * 20480 * p * 2)
    assert saved / 2**30 == pytest.approx(2.73, abs=0.01)


def test_the_embedding_keeps_its_dropout_mask_only() -> None:
    """The embedding's output is the first layer's input (counted there); with dropout one byte per
    element is kept, / t with sequence parallelism (Korthikanti et al. §4.3: s·b·h·p/t)."""
    sched = build_schedule("1f1b", 4, 8)
    for spec, tp, sp, mask in (
        (GPT, 1, False, SBH),
        (GPT, 2, True, SBH / 2),
        (GPT, 2, False, SBH),
        (LLAMA, 2, True, 0),
    ):
        cost = _cost(spec, tp=tp, sequence_parallel=sp)
        first, second = (cost.activation_bytes(Action(s, F, 0), sched) for s in (0, 1))
        assert first - second == mask, (spec.family, tp, sp)


def test_fp8_with_fused_attention_keeps_the_attention_output_besides_its_fp8_copy() -> None:
    """Transformer Engine's fused attention saves its 16-bit output for the backward; the output
    projection saves its FP8 copy instead of its input: 2·h/t bytes per token more than with eager
    attention, whose output is not saved by the core."""
    for tp in (1, 2):
        kw = dict(mesh=Mesh(tp=tp, pp=4), gpu="h100-sxm", dtype="fp8")
        eager = TransformerCost(LLAMA, attention="eager", **kw)
        fused = TransformerCost(LLAMA, attention="flash", **kw)
        extra = fused.layer_stored_bytes() - eager.layer_stored_bytes("selective")  # no a·s² scores
        assert extra == pytest.approx(SBH * fused_output_units(LLAMA, tp))
        assert extra == pytest.approx(SBH * 2 / tp)


def test_stage_outputs_on_the_command_line(capsys) -> None:
    argv = ["simulate", "--model", "gpt", "--layers", "8", "--hidden", "256", "--heads", "8"]
    argv += ["--seq-len", "64", "--vocab", "1000", "--pp", "4", "--microbatches", "8"]
    argv += ["--gpu", "a100-80gb", "--gpus-per-node", "4", "--schedule", "1f1b"]
    peaks = {}
    for mode in ("freed", "kept", "step"):
        assert main([*argv, "--stage-outputs", mode, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        peaks[mode] = report["per_rank"][0]["peak_memory_bytes"]
    assert peaks["kept"] - peaks["freed"] == 4 * SBH * 2  # four microbatches in flight on rank 0
    # rank 0 peaks with 4 in flight and 4 outputs already held, beside 8 gradient receive buffers
    assert peaks["step"] - peaks["kept"] == (4 + 8) * SBH * 2
    with pytest.raises(SystemExit):
        main([*argv, "--stage-outputs", "sometimes"])
    assert "--stage-outputs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--stage-outputs must be one of freed, kept"):
        _cost(GPT, stage_outputs="sometimes")


def test_the_last_chunk_keeps_the_final_norm_and_output_layer_inputs_and_the_logits() -> None:
    """Korthikanti et al. §4.3: 2·s·b·h/t for the final norm's input, 2·s·b·h/t for the output layer's
    input (with sequence parallelism; s·b·h·2 each without), 4·s·b·V/t for the fp32 logits."""
    sched = build_schedule("1f1b", 4, 8)
    for tp, sp, split in ((1, False, 1), (2, False, 1), (2, True, 2)):
        cost = _cost(LLAMA, tp=tp, sequence_parallel=sp)
        last, middle = (cost.activation_bytes(Action(s, F, 0), sched) for s in (3, 2))
        assert last - middle == 2 * SBH * 2 / split + 4 * 64 * 1000 / tp, (tp, sp)


def test_step_outputs_are_held_until_the_step_ends_beside_a_receive_buffer_per_microbatch() -> None:
    """torch.distributed.pipelining: ``output_chunks`` keeps every output (the last stage's: its 16-bit
    logits) until the next step, and ``PipelineStage`` allocates an input and a gradient receive
    buffer per microbatch up front; the received input is the first layer's checkpointed input."""
    m, logits = 8, 2 * 64 * 1000
    sched = build_schedule("1f1b", 4, m)
    kept = _cost(GPT, stage_outputs="kept")
    step = _cost(GPT, stage_outputs="step")
    for stage in range(4):
        f_kept, f_step = (c.activation_bytes(Action(stage, F, 0), sched) for c in (kept, step))
        held = logits if stage == 3 else SBH * 2
        assert f_step - f_kept == (0 if stage == 0 else -SBH * 2) + (logits if stage == 3 else 0), stage
        assert step.activation_bytes(Action(stage, B, 0), sched) == -(f_step - held), stage
    for rank, ends in enumerate((1, 2, 2, 1)):
        diff = step.static_bytes(rank, sched) - kept.static_bytes(rank, sched)
        assert diff == ends * m * SBH * 2, rank
    # one rank alone is no pipeline: nothing held, nothing received
    single = build_schedule("1f1b", 1, m)
    alone = _cost(GPT, pp=1, stage_outputs="step")
    assert alone.activation_bytes(Action(0, B, 0), single) == -alone.activation_bytes(Action(0, F, 0), single)
    assert alone.static_bytes(0, single) == _cost(GPT, pp=1).static_bytes(0, single)


def test_the_loss_parallel_cross_entropy_keeps_16_bytes_per_logit() -> None:
    """PyTorch's ``loss_parallel`` backward, ``(zeros_like(x) + exp(x)) * grad``: x, the zeros, exp(x)
    and the sum live together (4 bytes each per logit); 12 without tensor parallelism, 4 fused."""
    sched = build_schedule("1f1b", 4, 8)
    for kernels, tp, per_logit in (("eager", 1, 12), ("eager", 2, 16), ("compiled", 2, 16), ("fused", 2, 4)):
        cost = _cost(LLAMA, tp=tp, kernels=kernels)
        last, middle = (cost.activation_bytes(Action(s, F, 0), sched) for s in (3, 2))
        assert last - middle == 2 * SBH * 2 + per_logit * 64 * 1000 / tp, (kernels, tp)
    # with sequence parallelism PyTorch's ColwiseParallel keeps the output layer's input all-gathered
    for kernels, head_input in (("eager", SBH * 2), ("fused", SBH * 2 / 2)):
        cost = _cost(LLAMA, tp=2, sequence_parallel=True, kernels=kernels)
        last, middle = (cost.activation_bytes(Action(s, F, 0), sched) for s in (3, 2))
        per_logit = 16 if kernels == "eager" else 4
        assert last - middle == SBH * 2 / 2 + head_input + per_logit * 64 * 1000 / 2, kernels


def test_fsdp_holds_the_root_group_gathered_from_the_forward_to_the_end_of_the_backward() -> None:
    """PyTorch's FSDP does not reshard the root group (embedding, final norm, output layer) after the
    forward: with re-gathering per layer a rank holds two layers and the root in 16 bits."""
    sched = build_schedule("1f1b", 1, 4)
    for tp in (1, 2):
        fsdp = _cost(LLAMA, pp=1, tp=tp, optimizer_sharding="fsdp")
        state = fsdp._chunk(0, sched).params * fsdp.state().total
        gathered = (
            2 * layer_parameters(LLAMA) / tp + embedding_parameters(LLAMA, tp) + head_parameters(LLAMA, tp)
        )
        assert fsdp.static_bytes(0, sched) - state == pytest.approx(2 * gathered), tp


def test_the_recomputation_transient_is_one_layers_dropped_activations_during_its_backward() -> None:
    """Korthikanti et al. Table 2: a layer keeps s·b·h·(34/t + 5·a·s/(h·t)) without recomputation
    (sequence parallel), 2·s·b·h/t with full recomputation, s·b·h·34/t with selective; the backward
    re-creates the difference for one layer at a time, in B and I only, on chunks with layers."""
    sched = build_schedule("zb-h1", 4, 8)
    s, a = 64, 8
    core = 5 * a * s * s  # the attention core's bytes at b = 1, t = 1
    for tp in (1, 2):
        for mode, attention, expected in (
            ("none", "eager", 0.0),
            ("full", "eager", (34 * SBH + core - 2 * SBH) / tp),
            ("full", "flash", (34 * SBH - 2 * SBH) / tp),
            ("selective", "eager", core / tp),
            ("selective", "flash", 0.0),
        ):
            cost = make_cost(
                mode, spec=GPT, mesh=Mesh(tp=tp, pp=4), gpu="a100-80gb", attention=attention,
                sequence_parallel=True,
            )  # fmt: skip
            for kind in (B, I):
                assert cost.transient_bytes(Action(1, kind, 0), sched) == expected, (tp, mode, attention)
            assert cost.transient_bytes(Action(1, F, 0), sched) == 0.0
            assert cost.transient_bytes(Action(1, W, 0), sched) == 0.0
    uneven = _cost(GPT, recompute="full", layout=parse_layout("E|t*3|t*3|t*2L"))
    assert uneven.transient_bytes(Action(0, B, 0), sched) == 0.0  # the embedding alone: nothing re-run
    assert uneven.transient_bytes(Action(1, B, 0), sched) > 0.0


def test_torchtitans_operator_policy_re_creates_what_it_does_not_save() -> None:
    kw = {"mesh": Mesh(tp=2, pp=4), "gpu": "h100-sxm", "sequence_parallel": True, "attention": "flash"}
    op = make_cost("op", spec=LLAMA, **kw)
    sched = build_schedule("1f1b", 4, 8)
    expected = op.layer_stored_bytes("none") - op.op_stored_bytes()
    assert expected > 0
    assert op.transient_bytes(Action(2, B, 0), sched) == expected


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_the_peak_adds_the_transient_to_the_live_bytes_before_the_backward(name) -> None:
    """1F1B-style orders: the first backward meets the most microbatches in flight, so the peak is
    static + those microbatches' checkpoints + one layer's transient, less on the last chunk what the
    output layer and the loss kept (freed before any layer is recomputed) — on the array path, the
    per-action path and a timeline alike."""
    v = 2 if name == "interleaved-1f1b" else None
    sched = build_schedule(name, 4, 8, v)
    full = _cost(GPT, recompute="full", attention="eager")
    layer = full.layer_transient()
    assert layer == 34 * SBH + 5 * 8 * 64 * 64 - 2 * SBH
    last = sched.num_stages - 1
    head = output_kept_bytes(full)
    assert full.transient_bytes(Action(last, B, 0), sched) == layer - head > 0
    fast = simulate(sched, full)
    with patch.object(engine, "compile_fast", return_value=None):
        slow = simulate(sched, full)
    assert fast.peak_memory == slow.peak_memory
    assert peak_memory(fast.timeline, fast.source, full) == pytest.approx(list(fast.peak_memory), rel=1e-12)
    # the running sum of activation bytes (the peak before the transient was priced) + the transient;
    # the last rank peaks in the last chunk's first backward, which recomputes after freeing the head's
    # (a split backward's I also keeps the output gradients it hands to W, from I to W: not part of
    # the running sum here)
    for r, peak in enumerate(fast.peak_memory):
        deltas = [
            full.activation_bytes(a, fast.source) - _handed(full, a, fast.source)
            for a in fast.source.actions[r]
        ]
        base = peak_from_deltas(deltas, full.static_bytes(r, fast.source))
        expected = base + (layer - head if r == 3 else layer)
        # ZB-H1's delayed W passes hold several microbatches' handed gradients: a later, higher peak
        assert peak >= expected if name == "zb-h1" else peak == expected, r


def _handed(cost, action, sched) -> float:
    """What ``action`` adds to the W store (I: +, W: −) per :func:`deferred_grad_output_bytes`."""
    if action.kind not in (I, W):
        return 0.0
    chunk = cost._chunk(action.stage, sched)
    handed = deferred_grad_output_bytes(cost, chunk.layers, action.stage == sched.num_stages - 1)
    return handed if action.kind == I else -handed


def test_simulate_shows_the_transient_as_its_own_memory_part(capsys) -> None:
    argv = ["simulate", "--model", "gpt", "--layers", "8", "--hidden", "256", "--heads", "8"]
    argv += ["--seq-len", "64", "--vocab", "1000", "--pp", "4", "--microbatches", "8"]
    argv += [
        "--gpu",
        "a100-80gb",
        "--gpus-per-node",
        "4",
        "--schedule",
        "1f1b",
        "--attention",
        "eager",
        "--json",
    ]
    parts = {}
    for mode in ("none", "full"):
        assert main([*argv, "--recompute", mode]) == 0
        parts[mode] = json.loads(capsys.readouterr().out)["per_rank"][1]["memory_parts"]
    assert parts["none"]["recompute_transient"] == 0.0
    assert parts["full"]["recompute_transient"] == 34 * SBH + 5 * 8 * 64 * 64 - 2 * SBH  # one layer
    # rank 1: three microbatches' checkpoints of its two layers, 2·s·b·h bytes each
    assert parts["full"]["activations"] == 3 * 2 * 2 * SBH


def test_pytorch_tensor_parallelism_keeps_the_linear_inputs_all_gathered() -> None:
    """torchtitan's ``PrepareModuleInput`` gathers the sequence-sharded norm output once per attention
    and MLP module and the column-parallel linears save it whole: 2 × 2·s·b·h·(1 − 1/t) bytes more
    than Megatron's sequence-parallel count, nothing more under full recomputation."""
    sched = build_schedule("1f1b", 4, 8)
    for mode, extra in (("none", 4 * SBH * (1 - 1 / 4)), ("full", 0.0)):
        fused, eager = (
            _cost(LLAMA, tp=4, sequence_parallel=True, recompute=mode, kernels=k) for k in ("fused", "eager")
        )
        assert eager.activation_bytes(Action(1, F, 0), sched) - fused.activation_bytes(
            Action(1, F, 0), sched
        ) == pytest.approx(2 * extra), mode  # two layers on stage 1
    full = _cost(LLAMA, tp=4, sequence_parallel=True, recompute="full", kernels="eager")
    plain = _cost(LLAMA, tp=4, sequence_parallel=True, recompute="full")
    assert full.layer_transient() - plain.layer_transient() == pytest.approx(4 * SBH * (1 - 1 / 4))
