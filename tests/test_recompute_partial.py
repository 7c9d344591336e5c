"""Megatron-LM's partial recomputation (``--recompute full --recompute-method uniform|block
--recompute-num-layers N``, cost/partial_recompute.py) and the recomputation transient of a mixture
of experts' layers (cost/moe_cost.py): exact bytes and times on tiny specs, the cases that equal
``--recompute full``, one-line errors, and the plan file's record of the options."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from _cli_json import cli_json
from pipewright.cli import main
from pipewright.cost.chunk_memory import deferred_grad_output_bytes, output_kept_bytes
from pipewright.cost.comm import Mesh
from pipewright.cost.moe import moe_stored_units
from pipewright.cost.moe_cost import moe_of
from pipewright.cost.partial_recompute import recompute_groups
from pipewright.cost.recompute import make_cost, recompute_flops_per_layer
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.schedules import build_schedule
from pipewright.sim.engine import simulate

GPT = ModelSpec("gpt", 12, 256, 8, 1000, 64)  # pp 3: four layers per chunk
SBH = 64 * 256  # one s·b·h tensor of 16-bit elements is 2·SBH bytes; flash, t = 1: 34·SBH per layer
KW = {"spec": GPT, "mesh": Mesh(tp=1, pp=3), "gpu": "a100-80gb", "attention": "flash"}
SCHED = build_schedule("1f1b", 3, 6)
ACTIONS = [Action(s, k, 0) for s in range(3) for k in (F, B, I, W)]


def _partial(method: str, n: int, **kw):
    return make_cost("full", recompute_method=method, recompute_num_layers=n, **{**KW, **kw})


def _same(a, b) -> None:
    for act in ACTIONS:
        assert a.activation_bytes(act, SCHED) == b.activation_bytes(act, SCHED), act
        assert a.transient_bytes(act, SCHED) == b.transient_bytes(act, SCHED), act
        assert a.compute_time(act, SCHED) == pytest.approx(b.compute_time(act, SCHED), rel=1e-12), act
        assert a.flops(act, SCHED) == b.flops(act, SCHED), act


def test_groups_follow_megatrons_checkpointed_forward() -> None:
    assert recompute_groups("uniform", 3, 4) == ((0, 3), (3, 4))  # the last group cut at the chunk
    assert recompute_groups("block", 3, 4) == ((0, 1), (1, 2), (2, 3))
    assert recompute_groups("block", 5, 2) == ((0, 1), (1, 2))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_block_recomputes_the_first_n_layers_and_keeps_the_rest(n: int) -> None:
    """Middle chunk, four layers: N keep their input (2·SBH), 4 − N keep 34·SBH; W frees the kept
    layers' linear inputs (2·(3h + 4h) = 14·SBH each; the output gradients I hands it, 18·SBH a layer,
    make Zero Bubble's 32); time and FLOPs add N layers' recomputed forwards."""
    none, full, block = make_cost("none", **KW), make_cost("full", **KW), _partial("block", n)
    f = (2 * n + 34 * (4 - n)) * SBH
    mem = {k: block.activation_bytes(Action(1, k, 0), SCHED) for k in (F, B, I, W)}
    hand = deferred_grad_output_bytes(block, 4, False)  # the output gradients I hands to W
    assert mem == {F: f, B: -f, W: -(4 - n) * 14 * SBH - hand, I: -(f - (4 - n) * 14 * SBH) + hand}
    for kind in (F, B, I, W):
        act = Action(1, kind, 0)
        share = n / 4 if kind in (B, I) else 0.0
        t_none, t_full = none.compute_time(act, SCHED), full.compute_time(act, SCHED)
        assert block.compute_time(act, SCHED) == pytest.approx(t_none + share * (t_full - t_none), rel=1e-12)
    extra = block.flops(Action(1, I, 0), SCHED) - none.flops(Action(1, I, 0), SCHED)
    assert extra == n * recompute_flops_per_layer(GPT, 1, "full")
    # the transient: the unrecomputed layers' backward runs first; B frees their 34·SBH, I keeps
    # the linear inputs W needs (frees 34 − 14 = 20·SBH each) and adds the output gradients it hands
    # to W — one layer re-creates 32·SBH
    assert block.transient_bytes(Action(1, B, 0), SCHED) == 0.0
    handed = (4 - n) * deferred_grad_output_bytes(block, 1, False)
    assert block.transient_bytes(Action(1, I, 0), SCHED) == max(0, (32 - 20 * (4 - n)) * SBH + handed)


@pytest.mark.parametrize(("n", "transient"), [(2, 66), (3, 98), (4, 134)])
def test_uniform_keeps_each_groups_input_and_re_creates_a_group(n: int, transient: int) -> None:
    """Groups of N: ⌈4/N⌉ inputs kept; the backward re-runs the last group first, then the full
    groups, each re-creating N·34·SBH less its input (less the later groups' freed inputs)."""
    full, uniform = make_cost("full", **KW), _partial("uniform", n)
    kept = -(-4 // n) * 2 * SBH
    mem = {k: uniform.activation_bytes(Action(1, k, 0), SCHED) for k in (F, B, I, W)}
    hand = deferred_grad_output_bytes(uniform, 4, False)  # the output gradients I hands to W
    assert mem == {F: kept, B: -kept, I: -kept + hand, W: -hand}
    for kind in (B, I):
        assert uniform.transient_bytes(Action(1, kind, 0), SCHED) == transient * SBH
    head = output_kept_bytes(uniform)
    assert uniform.transient_bytes(Action(2, B, 0), SCHED) == transient * SBH - head
    for act in ACTIONS:
        assert uniform.compute_time(act, SCHED) == full.compute_time(act, SCHED)
    # 1F1B, rank 1: two microbatches in flight at its first backward, then the group re-created
    peak = simulate(SCHED, uniform).peak_memory[1]
    assert peak == uniform.static_bytes(1, SCHED) + 2 * kept + transient * SBH


def test_n_at_the_chunks_layers_or_uniform_one_is_plain_full() -> None:
    full = make_cost("full", **KW)
    _same(_partial("block", 4), full)
    _same(_partial("uniform", 1), full)


MOE = replace(
    ModelSpec("llama", 8, 256, 8, 1000, 64, ffn_hidden=704, family="llama", kv_heads=2, mlp="swiglu"),
    moe_experts=4,
    moe_top_k=2,
    moe_dense_layers=1,
)


def test_the_moe_transient_re_creates_the_routed_tokens_expert_activations() -> None:
    """A MoE layer under full recomputation re-creates what it stores without recomputation (with
    the k·φ token slots routed to the rank) less its input; a chunk with a dense layer and a MoE
    layer re-creates the larger."""
    sched = build_schedule("1f1b", 4, 8)
    kw = {"spec": MOE, "mesh": Mesh(tp=1, pp=4), "gpu": "a100-80gb", "attention": "flash"}
    full = make_cost("full", moe_imbalance=1.5, **kw)
    units = moe_stored_units(MOE, moe_of(MOE, 1.5), 1)
    expected = (units - 2) * SBH
    for stage in (0, 1):  # layers 0 (dense) and 1; layers 2 and 3
        assert full.transient_bytes(Action(stage, B, 0), sched) == expected
    dense = make_cost("full", **{**kw, "spec": replace(MOE, moe_experts=0)})
    assert dense.transient_bytes(Action(1, B, 0), sched) < expected
    assert make_cost("none", moe_imbalance=1.5, **kw).transient_bytes(Action(1, B, 0), sched) == 0.0


def test_partial_recomputation_of_experts_prices_the_all_to_alls_of_the_recomputed_layers() -> None:
    """ep 2: block N = the chunk's layers is full recomputation, all-to-alls included; N = 1 re-runs
    half the chunk's MoE layers' all-to-alls."""
    sched = build_schedule("1f1b", 4, 8)
    kw = {"spec": MOE, "mesh": Mesh(tp=1, pp=4, dp=2, ep=2), "gpu": "h100-sxm", "attention": "flash"}
    full, none = make_cost("full", **kw), make_cost("none", **kw)
    block = make_cost("full", recompute_method="block", recompute_num_layers=2, **kw)
    half = make_cost("full", recompute_method="block", recompute_num_layers=1, **kw)
    act = Action(1, B, 0)
    for kind in (F, B, I, W):
        a = Action(1, kind, 0)
        assert block.exposed_comm(a, sched) == pytest.approx(full.exposed_comm(a, sched), rel=1e-12)
        assert block.transient_bytes(a, sched) == full.transient_bytes(a, sched)
    assert half.exposed_comm(act, sched) == pytest.approx(
        (full.exposed_comm(act, sched) + none.exposed_comm(act, sched)) / 2, rel=1e-12
    )


@pytest.mark.parametrize(
    ("mode", "kw", "message"),
    [
        ("selective", {"recompute_method": "block"}, "apply to --recompute full"),
        ("full", {"recompute_num_layers": 2}, "needs --recompute-method"),
        ("full", {"recompute_method": "block", "recompute_num_layers": 0}, "at least 1"),
        ("full", {"recompute_method": "other"}, "must be one of uniform, block"),
        ("full", {"recompute_method": "uniform", "recompute_num_layers": 5}, "exceeds the 4 layers"),
    ],
)
def test_errors(mode: str, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_cost(mode, **KW, **kw).activation_bytes(Action(1, F, 0), SCHED)


SIM = shlex.split(
    "simulate --model gpt --layers 12 --hidden 256 --heads 8 --seq-len 64 --vocab 1000 --pp 3 "
    "--microbatches 6 --gpu a100-80gb --gpus-per-node 3 --schedule 1f1b"
)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recompute", "selective", "--recompute-method", "block"], "apply to --recompute full"),
        (["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "9"], "exceeds"),
    ],
)
def test_simulate_errors_in_one_line(flags: list[str], message: str, capsys) -> None:
    assert main([*SIM, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


PLAN = shlex.split(
    "--model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16 "
    "--mlp swiglu --gpu h100-sxm --nodes 1 --gpus-per-node 8 --global-batch-size 32 --tp 1 --pp 1 --dp 8 "
    "--microbatch-sizes 1 --cp 1 --schedules 1f1b --no-baselines --no-progress --recompute full"
)


def test_the_plan_file_records_the_method_and_simulate_plan_prices_it(tmp_path, capsys) -> None:
    path = str(tmp_path / "plan.json")
    method = ["--recompute-method", "block", "--recompute-num-layers", "2"]
    data = cli_json(["plan", *PLAN, *method, "-o", path])
    assert (data["recompute"], data["recompute_method"], data["recompute_num_layers"]) == ("full", "block", 2)
    # N above every chunk's layers recomputes whole chunks (as Megatron-LM does): recorded as the chunk's
    many = cli_json(["plan", *PLAN, "--recompute-method", "block", "--recompute-num-layers", "9"])
    assert many["recompute_num_layers"] == 4
    cluster = ["--gpu", "h100-sxm", "--nodes", "1", "--gpus-per-node", "8"]
    from_file = cli_json(["simulate", "--plan", path, *cluster])
    by_flags = cli_json(["simulate", "--plan", path, *cluster, *method])
    plain = cli_json(["simulate", "--plan", path, *cluster, "--recompute-method", "uniform"])
    assert from_file == by_flags
    # the planner simulated its plan with the method: its numbers are the file's
    assert data["predicted"]["iteration_time_s"] == pytest.approx(from_file["iteration_time_s"], rel=1e-12)
    peak = from_file["memory"]["peak_bytes"]
    assert data["predicted"]["peak_memory_bytes"] == pytest.approx(peak, rel=1e-12)
    assert from_file["memory"]["peak_bytes"] > plain["memory"]["peak_bytes"]  # two layers keep all
    assert main(["export-plan", path, "--to", "megatron"]) == 0
    out = capsys.readouterr().out.split()
    assert out[out.index("--recompute-method") :][:4] == [
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "recompute_num_layers": 0}))
    assert main(["simulate", "--plan", str(bad), *cluster]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and '"recompute_num_layers" a positive integer' in err
    assert main(["plan", *PLAN[:-1], "none", *method]) == 2
    assert "apply to --recompute full" in capsys.readouterr().err
