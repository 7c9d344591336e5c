"""The planner through public interfaces only, and a plan's device assignment applied as a mesh placement
that `simulate --plan` and `train --plan` read alike."""

from __future__ import annotations

import json

import pytest

from pipewright.cost.comm import Mesh
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import PipewrightError
from pipewright.ir import Action, F
from pipewright.models.presets import resolve_model
from pipewright.schedules import build_schedule
from pipewright.topology import Edge, Node, Topology


def test_chunk_costs_is_the_table_the_cost_model_prices() -> None:
    spec = resolve_model("gpt3-xl")
    cost = TransformerCost(spec, microbatch=2, mesh=Mesh(tp=1, pp=4), layout=(3, 5, 6, 10))
    sched = build_schedule("1f1b", 4, 8)
    for stage in range(4):
        chunk = cost.chunk_costs(stage, (3, 5, 6, 10))
        assert chunk.flops[F] == cost.flops(Action(stage, F, 0), sched)
        assert chunk.params * cost.bytes_per_param == cost.static_bytes(stage, sched)
    one = cost.chunk_costs(1, (0, 1, 0))
    two = cost.chunk_costs(1, (0, 2, 0))
    assert two.flops[F] == pytest.approx(2 * one.flops[F])
    assert two.memory[F] == pytest.approx(2 * one.memory[F])


def test_neighbours_bonds_parallel_links_and_is_read_only() -> None:
    nodes = [Node("a", "a100-80gb"), Node("b", "a100-80gb"), Node("sw")]
    edges = [
        Edge("a", "b", "nvlink3", 10.0, 1e-6),
        Edge("a", "b", "nvlink3", 5.0, 2e-6),
        Edge("a", "sw", "ib", 3.0, 1e-5),
    ]
    topo = Topology(nodes, edges)
    assert dict(topo.neighbours("a")) == {"b": (15.0, 1e-6), "sw": (3.0, 1e-5)}
    assert dict(topo.neighbours("sw")) == {"a": (3.0, 1e-5)}
    with pytest.raises(TypeError):
        topo.neighbours("a")["c"] = (1.0, 0.0)  # type: ignore[index]
    with pytest.raises(PipewrightError, match="no node 'x'"):
        topo.neighbours("x")


def _scrambled() -> Topology:
    """Four CPU devices listed a0, b0, a1, b1: a0–a1 and b0–b1 are fast pairs, the pairs joined by a
    slow link, so the planner's tp groups are not the given order's neighbours."""
    nodes = [Node(n, "cpu", n[0]) for n in ("a0", "b0", "a1", "b1")]
    edges = [
        Edge("a0", "a1", "nvlink3", 300e9, 3e-6),
        Edge("b0", "b1", "nvlink3", 300e9, 3e-6),
        Edge("a1", "b0", "eth-25g", 3.125e9, 15e-6),
    ]
    return Topology(nodes, edges, "scrambled4")


def test_simulate_and_train_put_every_coordinate_on_the_same_device(tmp_path, capsys) -> None:
    """`pipewright plan` → plan.json; `simulate --plan` prices each (tp, pp, dp) on a device and `train
    --plan` runs it on a process (process r = device r of the plan's topology): the same device."""
    from pipewright.cli import build_parser, main
    from pipewright.cli.simulate import _model_setup
    from pipewright.plan.apply import simulate_plan
    from pipewright.runspec import defaults, with_values
    from pipewright.runtime.parallel.process_mesh import ParallelMesh
    from pipewright.runtime.setup.config import TrainConfig
    from pipewright.training.plan_values import plan_values

    topo = _scrambled()
    topo_path, plan_path = tmp_path / "topo.json", tmp_path / "plan.json"
    topo.save(topo_path)
    argv = ["plan", "--model", "gpt-small-cpu", "--layers", "4", "--topology", str(topo_path),
            "--global-batch-size", "8", "--tp", "2", "--pp", "2", "--schedules", "1f1b",
            "--no-progress", "--no-baselines", "-o", str(plan_path)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    plan = json.loads(plan_path.read_text())
    assert plan["placement"] != [0, 1, 2, 3]  # the given order would split the fast pairs
    # the tensor-parallel pairs are the fast pairs
    assert {frozenset(plan["devices"][0:2]), frozenset(plan["devices"][2:4])} == {
        frozenset({"a0", "a1"}),
        frozenset({"b0", "b1"}),
    }

    args = build_parser().parse_args(["simulate", "--plan", str(plan_path), "--topology", str(topo_path)])
    sim = _model_setup(*simulate_plan(args.spec)).comm

    config = TrainConfig.from_spec(with_values(defaults("train"), plan_values(str(plan_path))))
    config.check()
    layout = Mesh(config.tp, config.pp, config.dp, placement=config.placement_ranks())
    procs = [ParallelMesh(config.dp, config.pp, config.tp, r, "cpu", layout=layout) for r in range(4)]
    for tp in range(2):
        for pp in range(2):
            trained = next(m.rank for m in procs if m.coords == (0, pp, tp))
            assert topo.devices[trained] == sim.device_of(tp=tp, pp=pp, dp=0)
            assert topo.devices[trained] == plan["devices"][tp + 2 * pp]  # g = tp + t·(dp + d·pp)


def test_a_plan_placement_survives_another_rank_order() -> None:
    from pipewright.mesh import Mesh as PureMesh
    from pipewright.plan.apply import placed

    place = (3, 1, 0, 2, 5, 4, 7, 6)
    plan_mesh = PureMesh(2, 2, 2, placement=place)
    other = placed(PureMesh(2, 2, 2, "tp-pp-dp"), place)
    for g in range(8):
        c = plan_mesh.coords(g)
        assert other.device_of(c.tp, c.pp, c.dp) == plan_mesh.device_of(c.tp, c.pp, c.dp)


def test_a_bad_placement_is_a_one_line_error() -> None:
    from pipewright.errors import ConfigError
    from pipewright.runtime.setup.config import TrainConfig

    with pytest.raises(ConfigError, match="must list each of the 4 devices"):
        TrainConfig(pp=4, placement="0,1,1,3").check()
    with pytest.raises(ConfigError, match="comma-separated device indices"):
        TrainConfig(pp=4, placement="0,x").check()


def _placed_worker(rank: int, runs: list) -> list:
    from pipewright.runtime.core.trainer import Trainer

    out = []
    for run in runs:
        trainer = Trainer(run)  # builds its mesh from the config's placement, as `train --plan` does
        losses = [trainer.train_step(step)["loss"] for step in range(2)]
        out.append((trainer.mesh.coords, losses, trainer.timeline is not None))
    return out


@pytest.mark.slow
def test_training_with_a_placement_runs_each_rank_on_its_process(tmp_path) -> None:
    """2 gloo processes, pp 2, through the real trainer: the placement (1, 0) — global rank g on process
    (1, 0)[g] — gives each process the coordinates of the rank placed on it and the losses of the
    identity placement, and process 0 (now pp rank 1) still receives the measured timeline."""
    from dataclasses import replace

    import numpy as np

    from _queue_spawn import fork_launch
    from pipewright.data.tokens import write_tokens
    from pipewright.runtime.setup.config import TrainConfig
    from pipewright.training import prepare

    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 5_000), vocab_size=256)
    base = TrainConfig(layers=4, hidden=32, heads=4, vocab=256, seq_len=16, pp=2, dp=1, microbatches=4,
                       microbatch_size=1, steps=2, data=str(data), progress=False, artifacts=False,
                       out=str(tmp_path / "run"))  # fmt: skip
    place = (1, 0)
    runs = [prepare(base), prepare(replace(base, placement=",".join(map(str, place))))]
    results = fork_launch(_placed_worker, 2, (runs,), timeout_s=600)
    layout = Mesh(1, 2, 1, placement=place)
    for process, per_run in enumerate(results):
        (ident, loss_id, _), (coords, loss_placed, has_timeline) = per_run
        c = layout.coords(layout.rank_on_device(process))
        i = Mesh(1, 2, 1).coords(process)
        assert ident == (i.dp, i.pp, i.tp) and coords == (c.dp, c.pp, c.tp)
        assert loss_placed == pytest.approx(loss_id, rel=1e-6)
        assert has_timeline == (process == 0)
