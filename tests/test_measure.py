"""``train --dry-run --measure``: the real program of a rank run on fake tensors and the fake process
group, against the simulator. Tiny Llama stages, one pipeline rank per schedule (the full-size table is
in tests/test_measure_table.py, from package data)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from _hf_families import FAMILIES, write_config
from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.measure import MAX_DEVICES, measure_run
from pipewright.training import config_from_values

TINY = dict(
    model="llama",
    layers=4,
    hidden=64,
    heads=4,
    ffn_hidden=128,
    seq_len=32,
    vocab=256,
    pp=2,
    microbatches=2,
    microbatch_size=1,
    precision="bf16",
    progress=False,
)


def _config(**values):
    """A TrainConfig by field name and feature option (``weight_policy="stash"``)."""
    return config_from_values(values)


SCHEDULES = [
    ("1f1b", {}),
    ("gpipe", {}),
    ("interleaved-1f1b", {"virtual": 2}),
    ("looped-bfs", {"virtual": 2}),
    ("zb-h1", {}),
    ("zb-h2", {}),
    ("zb-auto", {}),
    ("zbv", {}),
    ("v-half", {}),
    ("v-min", {}),
    ("dualpipev", {"microbatches": 4}),
    ("1f1b-overlap", {}),
    ("zbv-torch", {}),
]


@pytest.mark.parametrize(("schedule", "extra"), SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_every_schedule_matches_the_simulator_in_flops_and_bytes(schedule, extra):
    (cmp,) = measure_run(_config(**{**TINY, **extra}, schedule=schedule), [0])
    m, p = cmp.measured, cmp.predicted
    kinds = {k for k in m.flops if k != "step"} | set(p.flops)
    assert kinds and kinds <= {"F", "B", "I", "W"}
    for kind in kinds:  # every matrix product and attention of the real step, as the cost model prices it
        assert m.flops.get(kind, 0) == pytest.approx(p.flops.get(kind, 0.0), rel=0.01), kind
    assert cmp.boundary_bytes == p.message_bytes == 1 * 32 * 64 * 2  # b·s·h bf16
    # the peak falls inside an action of the schedule, and the static bytes are the state's
    assert m.peak_action == "optimizer step" or m.peak_action[0].isdigit()
    parts = p.parts
    edges = parts["embedding_output_layer"] / 16  # bf16 weights and grads + fp32 master and Adam
    assert m.static["params"] == pytest.approx(parts["weights"] + 2 * edges, rel=0.01)
    assert m.static["optimizer"] == pytest.approx(parts["optimizer_state"] + 12 * edges, rel=0.01)


def test_the_parts_of_a_peak_at_the_optimizer_step_add_up_to_its_total():
    """Full recomputation on the tiny stages: the peak is the optimizer step's (its fp32 gradient
    copies), measured and simulated; the simulated parts become the step's and ``total`` is their sum,
    the simulated peak + what it does not count (buffers in flight, the allocator's reserve)."""
    (cmp,) = measure_run(_config(**TINY, recompute="full", schedule="1f1b"), [0])
    m, p = cmp.measured, cmp.predicted
    assert m.peak_action == "optimizer step" and p.parts["step_gradients"] > 0
    assert p.parts["activations"] == p.parts["recompute_transient"] == p.parts["communication_buffers"] == 0
    total, reserve = p.parts["total"], p.parts["allocator_reserve"]
    assert sum(v for k, v in p.parts.items() if k != "total") == pytest.approx(total, rel=1e-12)
    assert reserve == pytest.approx(0.05 * (total - reserve), rel=1e-12)
    assert total - reserve == pytest.approx(p.peak_bytes, rel=1e-12)  # no buffers in flight


def test_tensor_parallel_sequence_parallel_rank_matches_flops_and_counts_its_collectives():
    config = _config(**{**TINY, "tp": 2, "sequence_parallel": True}, schedule="1f1b")
    (cmp,) = measure_run(config, [1])
    m, p = cmp.measured, cmp.predicted
    for kind in ("F", "B"):
        assert m.flops[kind] == pytest.approx(p.flops[kind], rel=0.01)
    assert cmp.boundary_bytes == p.message_bytes == 32 * 64 * 2 // 2  # 1/t of the boundary
    assert m.comm[("all_gather", "tp")] > 0 and m.comm[("reduce_scatter", "tp")] > 0
    gathers, scatters = m.comm_count[("all_gather", "tp")], m.comm_count[("reduce_scatter", "tp")]
    # every one moves one sequence-parallel activation [s, b, h] in 16 bits
    assert m.comm[("all_gather", "tp")] == gathers * 32 * 64 * 2
    assert m.comm[("reduce_scatter", "tp")] == scatters * 32 * 64 * 2
    # a group of column-parallel linears reading one input (q, k, v; gate, up; the output layer)
    # gathers it twice (forward, and again in backward for the weight gradients, keeping only its 1/t
    # chunk in between, as Megatron does) and reduce-scatters the summed input gradient once; a
    # row-parallel one reduce-scatters forward and gathers the gradient back: per microbatch, one
    # gather more than scatters for each of the rank's 2 layers' 2 groups and the output layer
    assert gathers - scatters == 2 * (2 * 2 + 1)
    assert (gathers, scatters) == (2 * (2 * 6 + 2), 2 * (2 * 4 + 1))


def test_tensor_parallel_bytes_are_the_cost_models_and_megatrons_re_gathers():
    """tp bytes, each collective's buffer (an all-reduce as its reduce-scatter and all-gather halves),
    equal on both sides: per microbatch 2 all-reduces a layer in F and in I, the embedding's in F, and
    the backward's re-gathers of each column-parallel group's input (2 a layer in I, as Megatron runs
    them; q, k, v share one input, gate and up one, as Megatron's fused linears); per step the
    all-reduce of the sequence-parallel norms' gradients (2 norms of h a layer, bf16) and the gradient
    norm's Σg² (8 bytes)."""
    (cmp,) = measure_run(_config(**{**TINY, "tp": 2, "sequence_parallel": True}, schedule="1f1b"), [0])
    m, p = cmp.measured, cmp.predicted
    act, layer_mb = 32 * 64 * 2, 2 * 2  # one activation; 2 layers × 2 microbatches
    embedding = 2 * act  # its all-reduce in F, one a microbatch
    megatron = 10  # a layer and microbatch: F 2 gathers + 2 scatters; backward 2 + 2 and 2 re-gathers
    step = 2 * (2 * 2 * 64 * 2 + 8)  # the norms' gradients and Σg², all-reduced once
    assert m.comm[("all_reduce", "tp")] == step // 2
    assert p.collective_bytes["tp"] == megatron * layer_mb * act + 2 * embedding + step
    assert cmp.rows()["tp bytes"] == (p.collective_bytes["tp"],) * 2
    assert "tp bytes" not in cmp.misses()


def test_tensor_parallel_bytes_of_the_last_rank_with_the_output_layers_re_gather():
    """On the last pipeline rank the output layer re-gathers its input for its weight gradient too
    (one b·s·h all-gather a microbatch, as Megatron-LM), and the final norm's gradient joins the
    step's all-reduce: measured and simulated tp bytes equal."""
    (cmp,) = measure_run(_config(**{**TINY, "tp": 2, "sequence_parallel": True}, schedule="1f1b"), [1])
    m, p = cmp.measured, cmp.predicted
    loss = 2 * 3 * 4 * 32  # a microbatch: the loss's 3 fp32 all-reduces of b·s
    assert m.comm[("all_reduce", "tp")] == loss + (2 * 2 + 1) * 64 * 2 + 8  # norms' gradients; Σg²
    assert cmp.rows()["tp bytes"] == (p.collective_bytes["tp"],) * 2
    assert "tp bytes" not in cmp.misses()


@pytest.mark.parametrize(
    ("layout", "calls", "nbytes"),
    [({}, 2, 2 * 6 * 64 * 2 + 8), ({"layout": "E|t*4L"}, 1, 8)],
    ids=["two layers", "embedding only"],
)
def test_gpt_first_stage_leaves_the_position_table_out_of_the_tp_all_reduce(layout, calls, nbytes):
    """GPT's first stage at tp 2 with sequence parallelism: the step's tp all-reduce holds each layer's
    two LayerNorms and two row-parallel biases (6h, bf16) and then Σg²'s 8 bytes, not the position
    table (s·h: added before the embedding's reduce-scatter, its gradient is whole on every tp rank);
    an embedding-only stage all-reduces Σg² alone. Measured and simulated tp bytes equal."""
    gpt = {**TINY, "model": "gpt", "tp": 2, "sequence_parallel": True, **layout}
    (cmp,) = measure_run(_config(**gpt, schedule="1f1b"), [0])
    m, p = cmp.measured, cmp.predicted
    assert m.comm_count[("all_reduce", "tp")] == calls
    assert m.comm[("all_reduce", "tp")] == nbytes
    assert cmp.rows()["tp bytes"] == (p.collective_bytes["tp"],) * 2
    assert "tp bytes" not in cmp.misses()


def test_tensor_parallel_without_sequence_parallelism_runs_megatrons_all_reduces():
    """Without sequence parallelism a layer and microbatch all-reduces 4 activations (after attention
    and the MLP in F; the input gradients of q, k, v summed, and of gate, up, in the backward), as
    Megatron's fused QKV and gate/up, and the gradient norm's 8-byte all-reduce: the priced bytes."""
    (cmp,) = measure_run(_config(**{**TINY, "tp": 2}, schedule="1f1b"), [0])
    m, p = cmp.measured, cmp.predicted
    assert set(k for k in m.comm if k[1] == "tp") == {("all_reduce", "tp")}
    assert m.comm_count[("all_reduce", "tp")] == 2 * (2 * 4 + 1) + 1  # + the embedding's; + the norm's
    assert m.comm[("all_reduce", "tp")] == 2 * (2 * 4 + 1) * 32 * 64 * 2 + 8
    assert cmp.rows()["tp bytes"] == (p.collective_bytes["tp"],) * 2


def test_hugging_face_llama_tensor_parallel_shares_the_projections_inputs(tmp_path):
    """A Hugging Face Llama under tp 2: q, k, v (and gate, up) share one input through a pre-hook, so a
    layer and microbatch all-reduces 4 activations, and the gradient norm's 8 bytes: the priced bytes."""
    folder = write_config(tmp_path, "llama", {**FAMILIES["llama"], "vocab_size": 256})
    fields = {"hf_model": str(folder), "seq_len": 32, "microbatch_size": 1, "pp": 2, "microbatches": 2}
    (cmp,) = measure_run(_config(**fields, tp=2, schedule="1f1b", progress=False), [0])
    m, p = cmp.measured, cmp.predicted
    assert m.comm_count[("all_reduce", "tp")] == 2 * (2 * 4 + 1) + 1  # 2 layers; the embedding; the norm
    assert cmp.rows()["tp bytes"] == (p.collective_bytes["tp"],) * 2


def test_context_parallel_ring_bytes_equal_the_simulators():
    """The ring's sends (forward K/V, backward K/V and the fp32 dK/dV) are what the cost model prices
    for the runtime's ring (``cp_comm="pipewright"``), byte for byte; the boundary message stays one
    stage output, not a ring block."""
    (cmp,) = measure_run(_config(**TINY, cp=2, schedule="1f1b"), [0])
    kv = 16 * 2 * 64 * 2  # one block: s/c tokens × (k + v) × h, bf16
    per_layer_mb = kv + kv + 2 * kv  # F (c − 1)·KV·e, backward again + the fp32 accumulator
    assert cmp.rows()["cp bytes"] == (2 * 2 * per_layer_mb,) * 2
    assert cmp.boundary_bytes == cmp.predicted.message_bytes == 16 * 64 * 2
    assert "cp bytes" not in cmp.misses() and "boundary message" not in cmp.misses()


def test_zero1_shards_the_optimizer_state_over_dp():
    plain, sharded = (
        measure_run(_config(**{**TINY, "dp": 2, "shard_optimizer": z}, schedule="1f1b"), [0])[0]
        for z in (False, True)
    )
    assert sharded.measured.static["optimizer"] == pytest.approx(
        plain.measured.static["optimizer"] / 2, rel=0.02
    )
    assert sharded.measured.comm[("reduce_scatter", "dp")] > 0


@pytest.mark.parametrize("schedule", ["async-1f1b", "async-zb-h1"])
def test_asynchronous_weight_stashing_steps_inside_the_schedule(schedule):
    fields = {**TINY, "precision": "fp32", "weight_policy": "stash"}
    (cmp,) = measure_run(_config(**fields, schedule=schedule), [0])
    m, p = cmp.measured, cmp.predicted
    for kind in ("F", "B", "I", "W"):
        assert m.flops.get(kind, 0) == pytest.approx(p.flops.get(kind, 0.0), rel=0.01)
    assert "STEP" in m.peak_action  # the per-microbatch optimizer steps hold the stashed weights


def test_cli_prints_json_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--dry-run", "--measure", "--measure-json", "--measure-ranks", "1"]
    for key, value in TINY.items():
        if key != "progress":
            args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["pp_rank"] == 1 and row["rows"]["FLOPs F"]["measured"] > 0
    assert list(tmp_path.iterdir()) == []  # no run folder


def test_check_measures_the_layout_it_would_check(capsys):
    args = ["check", "--measure", "--measure-ranks", "0"]
    for key, value in TINY.items():
        if key != "progress":
            args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rank 0 (pp 0, stages 0)" in out and "fits the 79.65 GiB per device" in out


def test_measure_without_dry_run_and_a_rank_outside_the_pipeline_are_one_line_errors(capsys):
    assert main(["train", "--measure"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --dry-run" in err
    with pytest.raises(ConfigError, match=r"pipeline ranks are 0\.\.1"):
        measure_run(_config(**TINY, schedule="1f1b"), [2])
    with pytest.raises(ConfigError, match="drop --init-from"):
        measure_run(_config(**TINY, schedule="1f1b", init_from="somewhere"), [0])


def test_a_layout_too_large_to_simulate_stops_at_once_writing_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert main(["train", "--measure-json", "--nproc", "100000000", "--dry-run"]) != 0
    assert time.perf_counter() - t0 < 5
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "100,000,000 processes" in captured.err and f"{MAX_DEVICES:,} devices" in captured.err
    assert list(tmp_path.iterdir()) == []


def test_adamw_is_fused_where_a_device_run_steps_and_unchanged_on_the_cpu():
    from torch import nn

    from pipewright.optim import build_optimizer

    def group_flags(device: str, dtype=torch.float32) -> tuple:
        named = [("w", nn.Parameter(torch.zeros(4, 4, device=device, dtype=dtype)))]
        group = build_optimizer("adamw", named, lr=1e-3).param_groups[0]
        return bool(group["fused"]), group["foreach"]

    assert group_flags("cpu") == (False, False)  # the for-loop step the CPU runs were made with
    assert group_flags("meta") == (True, None)  # what a CUDA run builds: no per-step temporaries
    assert group_flags("meta", torch.bfloat16) == (True, None)


def test_fp32_training_holds_16_bytes_a_parameter_and_asynchronous_stashes_are_priced():
    """fp32 weights are the masters (4 + 4 + Adam's 8 bytes, as the simulator now prices them), and an
    asynchronous policy's weight versions in flight are added to the simulated peak."""
    fields = {**TINY, "precision": "fp32"}
    (sync,) = measure_run(_config(**fields, schedule="1f1b"), [0])
    held = sync.measured.static["params"] + sync.measured.static["optimizer"]  # 4 + 8 (no .grad yet)
    parts = sync.predicted.parts
    state = parts["weights"] + parts["gradients"] + parts["optimizer_state"] + parts["embedding_output_layer"]
    assert held == pytest.approx(state * 12 / 16, rel=0.01)
    (stash,) = measure_run(_config(**fields, schedule="async-1f1b", weight_policy="stash"), [0])
    weights = parts["weights"] + parts["embedding_output_layer"] / 4  # rank 0's fp32 weights
    assert stash.predicted.parts["weight_versions"] == pytest.approx(weights, rel=0.01)  # p − r = 2 versions


def test_tied_embeddings_and_vocabulary_parallelism_run_their_real_steps():
    (tied,) = measure_run(_config(**TINY, schedule="1f1b", tie_embeddings=True), [1])
    assert tied.measured.flops["F"] == pytest.approx(tied.predicted.flops["F"], rel=0.01)
    assert tied.misses() == []
    fields = {**TINY, "model": "gpt", "precision": "fp32", "vocab_parallel": "alg1"}
    (vocab,) = measure_run(_config(**fields, schedule="1f1b"), [0])
    for kind in ("F", "B", "VS", "VT"):  # the shard's passes priced by the feature's cost model
        assert vocab.measured.flops[kind] == pytest.approx(vocab.predicted.flops[kind], rel=0.01), kind


def test_mixture_of_experts_routes_balanced_tokens_over_expert_parallel_ranks():
    """bincount has no meta kernel and the expert split sizes are read values: the measurement answers
    them as balanced routing does (what the simulator prices), so the FLOPs and the gradient bytes of
    the dense and expert groups equal the simulator's."""
    from pipewright.measure.routing import balanced_counts

    assert balanced_counts(10, 4).tolist() == [3, 3, 2, 2]
    fields = {**TINY, "model": "llama-moe-tiny", "dp": 4, "ep": 2}  # experts reduced over 2 replicas
    for key in ("layers", "hidden", "heads", "ffn_hidden"):
        fields.pop(key)
    (cmp,) = measure_run(_config(**fields, schedule="1f1b"), [0])
    m, p = cmp.measured, cmp.predicted
    for kind in ("F", "B"):
        assert m.flops[kind] == pytest.approx(p.flops[kind], rel=0.01), kind
    assert m.comm[("all_to_all", "ep")] > 0 and m.comm[("all_reduce", "expert-dp")] > 0
    assert cmp.rows()["dp bytes"][0] == cmp.rows()["dp bytes"][1]  # gradients, loss and norm: equal
    # the tokens' all-to-alls, dispatch and combine in F and in the backward, s·top-k·h in bf16 each
    calls = m.comm_count[("all_to_all", "ep")]
    assert calls % 4 == 0 and cmp.rows()["ep bytes"] == (calls * 32 * 2 * 32 * 2,) * 2
    assert m.comm[("all_to_all_counts", "ep")] > 0  # the routing's counts, apart (not priced)


def test_the_measure_runs_where_nccl_rules_are_installed(tmp_path, capsys, monkeypatch):
    """A process that has NCCL's rules over gloo installed (``nccl_rules.install``, as a test process
    that ran an in-process launch under ``PIPEWRIGHT_PG_RULES=nccl``) measures on the fake backend as
    any other: the rules are lifted for the fake group (its meta tensors) and put back after."""
    from pipewright.runtime.setup import nccl_rules

    monkeypatch.chdir(tmp_path)
    was = nccl_rules.active()
    nccl_rules.install()
    try:
        args = ["train", "--dry-run", "--measure", "--measure-json", "--measure-ranks", "0", "--pp", "1"]
        assert main([*args, "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["rank"] == 0
        assert nccl_rules.active()
    finally:
        if not was:
            nccl_rules.uninstall()
