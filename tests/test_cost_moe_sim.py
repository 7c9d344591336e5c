"""MoECost: mixture-of-experts layers in simulate's cost model (router, experts, all-to-all, memory)."""

import contextlib
import io
import json
from dataclasses import replace

import pytest

from pipewright.cli import main
from pipewright.cost.llama import cost_class
from pipewright.cost.moe import MoE, moe_model_parameters
from pipewright.cost.moe_cost import MoECost
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.ir import Action, F, I, W
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.schedules import build_schedule

MIXTRAL = resolve_model("mixtral-8x7b")
SCHED = build_schedule("1f1b", 2, 4)


def _cost(spec, **kw) -> TransformerCost:
    kw.setdefault("gpu", "h100-sxm")
    kw.setdefault("mesh", Mesh(pp=2))
    kw.setdefault("attention", "flash")
    return cost_class(spec)(spec, **kw)


def test_mixtral_parameters_as_laid_out_are_the_published_total():
    cost = _cost(MIXTRAL)
    assert isinstance(cost, MoECost)
    assert cost.parameters(SCHED) == pytest.approx(moe_model_parameters(MIXTRAL, MoE(8, 2)), rel=1e-12)


def test_one_expert_top_one_prices_the_dense_layer_plus_its_router():
    dense = replace(MIXTRAL, name="d", moe_experts=0)
    one = replace(MIXTRAL, name="m", moe_experts=1, moe_top_k=1)
    a, b = _cost(dense), _cost(one)
    router = 2 * MIXTRAL.seq_len * MIXTRAL.hidden * 1  # per layer and microbatch, E = 1
    layers = MIXTRAL.layers // 2
    for kind in (F, I, W):
        act = Action(0, kind, 0)
        assert b.model_flops(act, SCHED) - a.model_flops(act, SCHED) == pytest.approx(layers * router)
    assert b.parameters(SCHED) - a.parameters(SCHED) == MIXTRAL.layers * MIXTRAL.hidden


def test_expert_parallelism_divides_the_experts_and_adds_the_all_to_all():
    mesh1, mesh8 = Mesh(pp=2, dp=8), Mesh(pp=2, dp=8, ep=8)
    one, eight = _cost(MIXTRAL, mesh=mesh1), _cost(MIXTRAL, mesh=mesh8)
    expert = 3 * MIXTRAL.hidden * MIXTRAL.ffn_hidden
    drop = one.parameters(SCHED) - eight.parameters(SCHED)
    assert drop == pytest.approx(MIXTRAL.layers * 7 * expert, rel=1e-12)  # 8 experts → 1 per device
    chunk = eight._chunk(0, SCHED)
    a2a = eight.comm.collective_time("all_gather", 0, eight.a2a_bytes(), group="ep")
    assert a2a > 0
    dense_time = TransformerCost.kind_time(eight, chunk, F, 0)
    assert eight.kind_time(chunk, F, 0) - dense_time == pytest.approx(2 * chunk.moe_layers * a2a)
    assert eight.kind_time(chunk, W, 0) == pytest.approx(TransformerCost.kind_time(eight, chunk, W, 0))
    # ZeRO-1: the experts' optimizer state is sharded over their dp/ep = 1 replicas, i.e. not at all
    z = _cost(MIXTRAL, mesh=mesh8, optimizer_sharding="zero1")
    experts = z.expert_params(0, SCHED)
    gap = z.static_bytes(0, SCHED) - TransformerCost.static_bytes(z, 0, SCHED)
    assert gap == pytest.approx(experts * (18 - z.state().total))


def test_imbalance_slows_the_experts_not_the_model_flops():
    even, skew = _cost(MIXTRAL), _cost(MIXTRAL, moe_imbalance=1.5)
    act = Action(0, F, 0)
    assert skew.model_flops(act, SCHED) == even.model_flops(act, SCHED)
    assert skew.compute_time(act, SCHED) > even.compute_time(act, SCHED)
    with pytest.raises(ConfigError, match="--moe-imbalance must be at least 1"):
        _cost(MIXTRAL, moe_imbalance=0.5)


BASE = ["simulate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--nodes", "2", "--pp", "2"]
BASE += ["--dp", "8", "--schedule", "1f1b", "--global-batch-size", "16", "--layers", "4"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ep", "16"], "--ep 16 must divide --dp 8"),
        (["--ep", "4", "--moe-experts", "6"], "--ep 4 must divide the 6 experts"),
        (["--moe-top-k", "9"], "--moe-top-k 9 must be between 1 and --moe-experts 8"),
    ],
)
def test_bad_moe_input_is_one_line(extra, message, capsys):
    assert main([*BASE, *extra]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_simulate_takes_the_moe_shape_and_reports_memory_by_parts():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = [*BASE, "--ep", "8", "--shard-optimizer", "--moe-shared-experts", "1", "--json"]
        assert main(argv) == 0
    report = json.loads(out.getvalue())
    row = report["per_rank"][0]
    parts = row["memory_parts"]
    live = sum(v for k, v in parts.items() if k not in ("total", "allocator_reserve"))
    assert live - parts["communication_buffers"] == pytest.approx(row["peak_memory_bytes"], rel=1e-9)


def test_dualpipev_overlaps_the_all_to_all_of_its_pairs():
    from pipewright.plan.setup import model_setup
    from pipewright.schedules import build_schedule
    from pipewright.sim.pair_overlap import PairOverlapCost
    from pipewright.topology import cluster

    spec = replace(MIXTRAL, layers=8)
    topo = cluster(2, 8, "h100-sxm")
    mesh = Mesh(pp=2, dp=8, ep=8)
    setup = model_setup(spec, topo, mesh, build_schedule("dualpipev", 2, 8), 1, gpu="h100-sxm")
    assert isinstance(setup.cost, PairOverlapCost)
    over = setup.simulate().makespan
    blocking = replace(setup, cost=PairOverlapCost(setup.cost.base, setup.cost.exposed, overlap=False))
    assert over < blocking.simulate().makespan
    one = model_setup(spec, topo, mesh, build_schedule("1f1b", 2, 8), 1, gpu="h100-sxm")
    assert not isinstance(one.cost, PairOverlapCost)  # other schedules wait for the all-to-all


def test_plan_prices_the_moe_shape_and_its_imbalance(capsys):
    argv = ["plan", "--model", "mixtral-8x7b", "--layers", "4", "--gpu", "h100-sxm", "--nodes", "1"]
    argv += ["--gpus-per-node", "2", "--global-batch-size", "4", "--no-progress", "--no-baselines", "--json"]
    times = []
    for imbalance in ("1.0", "1.5"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, "--moe-imbalance", imbalance]) == 0
        times.append(json.loads(out.getvalue())["predicted"]["iteration_time_s"])
    assert times[1] > times[0]
    dense = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--global-batch-size", "8"]
    assert main([*dense, "--moe-imbalance", "1.5"]) != 0
    assert "--moe-imbalance needs a mixture-of-experts model" in capsys.readouterr().err
