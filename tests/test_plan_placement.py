"""The planner through public interfaces only, and a plan's device assignment applied as a mesh placement
that `simulate --plan` and `train --plan` read alike."""

from __future__ import annotations

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
