"""A tied model priced as the runtime trains it (``--tie-embeddings``, docs/cost-model.md "Tied
embeddings"): one stage holding both ends holds one V·h table (no second weight, gradient or optimizer
state); on different ranks the last keeps its own copy and the two ends all-reduce the table's gradient
each step — bytes the measured program moves to the byte; ``plan`` and ``simulate --plan`` agree to the
digit on a tied plan, which carries the option."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from pipewright.cli import main
from pipewright.cost.sharding import GRAD_DTYPE_BYTES, tied_step_bytes
from pipewright.cost.transformer import TransformerCost
from pipewright.ir import STEP, Action
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.plan.setup import model_setup
from pipewright.schedules.registry import build_schedule
from pipewright.topology import cluster

GPT = resolve_model("gpt", layers=4, hidden=64, heads=4, vocab=256, seq_len=32)
TIED = replace(GPT, tied_embeddings=True)
TABLE = GPT.vocab * GPT.hidden


def _cost(spec, pp: int) -> tuple[TransformerCost, object]:
    setup = model_setup(spec, cluster(1, pp, "h100-sxm"), Mesh(pp=pp), build_schedule("1f1b", pp, 4), 1)
    return setup.cost, setup.schedule


def test_one_stage_holds_one_table_and_prices_its_state_once():
    """pp 1: the tied GPT's one rank holds V·h parameters fewer — V·h × the bytes a parameter's state
    takes fewer static bytes — and its parameters are ModelSpec.num_parameters (the table counted once)."""
    (untied, sched), (tied, _) = _cost(GPT, 1), _cost(TIED, 1)
    assert untied.rank_parameters(0, sched) - tied.rank_parameters(0, sched) == TABLE
    assert tied.rank_parameters(0, sched) == TIED.num_parameters()
    drop = untied.static_bytes(0, sched) - tied.static_bytes(0, sched)
    assert drop == TABLE * tied.state().total


def test_the_last_rank_keeps_its_copy_and_the_two_ends_all_reduce_its_gradient():
    """pp 2: both ends hold their own table (static bytes as untied); each end's STEP all-reduces the
    table's gradient with the other (V·h in the gradient dtype over the pair), a middle stage none,
    and a V-shape order, whose one rank holds both ends, adds them locally (no collective)."""
    (untied, sched), (tied, _) = _cost(GPT, 2), _cost(TIED, 2)
    for r in (0, 1):
        assert tied.static_bytes(r, sched) == untied.static_bytes(r, sched)
        nbytes = tied_step_bytes(tied, r, sched)
        assert nbytes == TABLE * GRAD_DTYPE_BYTES[tied.grad_dtype] and tied_step_bytes(untied, r, sched) == 0
        step = Action(r, STEP, None)
        extra = tied.compute_time(step, sched) - untied.compute_time(step, sched)
        assert extra == pytest.approx(tied.comm.collective_time("all_reduce", r, nbytes, "pp", (0, 1)))
        assert extra > 0
    three = build_schedule("1f1b", 3, 4)
    assert tied_step_bytes(tied, 1, three) == 0  # a middle stage
    vshape = build_schedule("zbv", 2, 4)
    assert all(tied_step_bytes(tied, s, vshape) == 0 for s in range(vshape.num_stages))


def _cli_json(argv: list[str]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


TINY = dict(model="llama", layers=4, hidden=64, heads=4, ffn_hidden=128, seq_len=32, vocab=256)
TINY |= dict(microbatches=2, microbatch_size=1, precision="bf16")


def test_what_the_tied_program_measures_is_what_simulate_prices():
    """`train --dry-run --measure --tie-embeddings`: at pp 1 the peak and the static bytes within the
    measured table's 5 % (untied pricing would be 8 % over), the simulated drop from the untied model
    the table's state; at pp 2 on both ranks the tied all-reduce's bytes equal, nothing outside the
    targets."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--no-progress"]

    def measure(pp: int, ranks: str, *tie: str) -> list[dict]:
        argv = ["train", "--dry-run", "--measure", "--measure-json", "--measure-ranks", ranks, f"--pp={pp}"]
        return _cli_json([*argv, *args, *tie])

    (untied,), (tied,) = measure(1, "0"), measure(1, "0", "--tie-embeddings")
    for key in ("peak memory", "  static"):
        row = tied["rows"][key]
        assert row["simulated"] == pytest.approx(row["measured"], rel=0.05), key
    static = tied["simulated_parts_bytes"]
    state = sum(static[k] for k in ("weights", "gradients", "optimizer_state", "embedding_output_layer"))
    was = untied["simulated_parts_bytes"]
    before = sum(was[k] for k in ("weights", "gradients", "optimizer_state", "embedding_output_layer"))
    table = TINY["vocab"] * TINY["hidden"]
    assert before - state == table * (2 + 2 + 4 + 8)  # bf16 weight and gradient, fp32 master, Adam
    assert tied["misses"] == []
    for row in measure(2, "0,1", "--tie-embeddings"):
        assert row["rows"]["tied bytes"]["measured"] == row["rows"]["tied bytes"]["simulated"] > 0
        assert row["misses"] == []


@pytest.mark.parametrize("pp", [1, 2])
def test_plan_and_simulate_agree_to_the_digit_on_a_tied_model(tmp_path, pp):
    """A plan of a tied GPT under vTrain's setup (the optimizer step priced): its file records the
    tied model, `simulate --plan` prints the plan's prediction, and it prices what untied does not (pp
    1: less memory; pp 2: the ends' all-reduce in the step)."""
    model = ["--model", "gpt", "--layers", "12", "--hidden", "1024", "--heads", "16", "--seq-len", "1024"]
    setup = ["--gpu", "a100-80gb", "--nodes", "1", "--gpus-per-node", str(4 * pp)]
    setup += ["--framework", "deepspeed-megatron", "--dtype", "fp16", "--attention", "eager"]
    setup += ["--recompute", "full"]
    model += ["--vocab", "50257"]
    fixed = ["--tp", "2", "--pp", str(pp), "--dp", "2", "--global-batch-size", "32", "--no-progress"]
    predicted = {}
    for tie in ((), ("--tie-embeddings",)):
        path = tmp_path / f"plan{len(tie)}.json"
        planned = _cli_json(["plan", *model, *setup, *fixed, *tie, "--out", str(path), "--json"])
        assert json.loads(path.read_text())["model"]["tied_embeddings"] is bool(tie)
        simulated = _cli_json(["simulate", "--plan", str(path), *setup, "--json"])
        assert simulated["iteration_time_s"] == planned["predicted"]["iteration_time_s"]
        assert simulated["memory"]["peak_bytes"] == planned["predicted"]["peak_memory_bytes"]
        predicted[bool(tie)] = planned["predicted"]
    if pp == 1:
        assert predicted[True]["peak_memory_bytes"] < predicted[False]["peak_memory_bytes"]
        toml = tmp_path / "run.toml"  # plan -o run.toml: the RunSpec keeps the option
        _cli_json(["plan", *model, *setup, *fixed, "--tie-embeddings", "--out", str(toml), "--json"])
        assert "tie_embeddings = true" in toml.read_text()
    else:
        assert predicted[True]["iteration_time_s"] > predicted[False]["iteration_time_s"]


@pytest.mark.parametrize("pp", [1, 2])
def test_the_planners_estimate_prices_the_tied_model_as_its_simulation(pp):
    """The planner's quick estimate (plan/costs.py pieces, plan/search.py) of a tied GPT under
    deepspeed-megatron (optimizer step priced): its time and memory are its simulation's, and what
    tying changes it changes by the simulation's amount (pp 1: the table's state and the smaller
    gradient reduction and step; pp 2: the ends' all-reduce)."""
    from pipewright.cost.efficiency import default_efficiency
    from pipewright.cost.frameworks import framework
    from pipewright.hardware import accelerator
    from pipewright.plan.mapping import device_order
    from pipewright.plan.problem import Candidate, Problem
    from pipewright.plan.search import _Context, estimate
    from pipewright.plan.simulated import simulate_plan

    spec = resolve_model("gpt", layers=12, hidden=1024, heads=16, vocab=50304, seq_len=1024)
    topo = cluster(1, 4 * pp, "a100-80gb")
    eff = framework("deepspeed-megatron").efficiency(default_efficiency(accelerator("a100-80gb")))
    got = {}
    for tie in (False, True):
        prob = Problem(replace(spec, tied_embeddings=tie), topo, 32, efficiency=eff)
        ev = estimate(_Context(prob, device_order(topo)), Candidate(2, pp, 2, 1, 16, "1f1b"))
        sim = simulate_plan(prob, ev)
        assert ev.estimate == pytest.approx(sim.simulated, rel=1e-12)
        assert ev.peak_memory <= sim.simulated_memory
        got[tie] = (ev.estimate, ev.peak_memory, sim.simulated, sim.simulated_memory)
    est_time, est_mem, sim_time, sim_mem = (got[False][i] - got[True][i] for i in range(4))
    assert est_time == pytest.approx(sim_time, rel=1e-9) and est_time != 0
    padded = -(-spec.vocab // 256) * 256  # the planner's vocabulary: padded to 128·t (Megatron-LM)
    assert est_mem == sim_mem == (0 if pp > 1 else padded * spec.hidden / 2 * 18)  # fp16 + fp32 state
