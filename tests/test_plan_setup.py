"""plan.setup: the one builder of simulation setups, used by `pipewright simulate`, --compare-sim and
Table 1 — the command line and the library price a configuration identically, the gradient all-reduce
is part of a data-parallel iteration, and the rank order reaches the comm model."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD
from pipewright.mesh import Mesh
from pipewright.models.presets import resolve_model
from pipewright.plan.setup import cluster_topology, microbatches_per_pipeline, model_setup, unit_setup
from pipewright.schedules.registry import build_schedule

GPT = resolve_model("gpt", layers=8, hidden=1024, heads=16, vocab=32000, seq_len=1024)


def _setup(order: str = "tp-dp-pp", grad_reduce: str = "after", schedule: str = "interleaved-1f1b"):
    topology, gpu = cluster_topology("a100-80gb", nodes=2, gpus_per_node=4)
    sched = build_schedule(schedule, 2, 8, 2 if schedule == "interleaved-1f1b" else None)
    mesh = Mesh(tp=2, pp=2, dp=2, order=order)
    return model_setup(GPT, topology, mesh, sched, 2, gpu=gpu, grad_reduce=grad_reduce)


def _cli(*extra: str) -> dict:
    argv = [
        "simulate", "--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16",
        "--vocab", "32000", "--seq-len", "1024", "--gpu", "a100-80gb", "--nodes", "2",
        "--gpus-per-node", "4", "--tp", "2", "--pp", "2", "--dp", "2", "--virtual", "2",
        "--microbatch-size", "2", "--microbatches", "8", "--schedule", "interleaved-1f1b", "--json", *extra,
    ]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize(
    ("order", "grad_reduce"), [("tp-dp-pp", "after"), ("tp-dp-pp", "overlap"), ("tp-pp-dp", "after")]
)
def test_command_line_and_library_give_the_same_prediction(order: str, grad_reduce: str) -> None:
    report = _cli("--rank-order", order, "--grad-reduce", grad_reduce)
    result = _setup(order, grad_reduce).simulate()
    assert report["iteration_time_s"] == pytest.approx(result.iteration_time, rel=1e-12)
    assert report["bubble_fraction"] == pytest.approx(result.bubble_fraction, rel=1e-12)


def test_data_parallel_iterations_include_the_gradient_all_reduce() -> None:
    after, overlap = _setup(grad_reduce="after"), _setup(grad_reduce="overlap")
    for setup in (after, overlap):
        reduces = [a for row in setup.schedule.actions for a in row if a.kind == REDUCE_GRAD]
        assert sorted(a.stage for a in reduces) == list(range(setup.schedule.num_stages))
    # after: each rank's reductions close its row; overlap: one of them runs before the last backward
    assert all(a.kind == REDUCE_GRAD for row in after.schedule.actions for a in row[-2:])
    assert any(row[-2].kind != REDUCE_GRAD for row in overlap.schedule.actions)
    t_after, t_overlap = after.simulate().iteration_time, overlap.simulate().iteration_time
    assert t_overlap < t_after
    # the CLI's default with --model is Megatron-LM's: after the pipeline drains
    assert _cli()["iteration_time_s"] == pytest.approx(t_after, rel=1e-12)


def test_rank_order_moves_pipeline_neighbours() -> None:
    """tp-dp-pp puts the two stages on different nodes (InfiniBand), tp-pp-dp on one node (NVLink)."""
    megatron, replica_per_node = _setup("tp-dp-pp").comm, _setup("tp-pp-dp").comm
    assert megatron.device(0).split("/")[0] != megatron.device(1).split("/")[0]
    assert replica_per_node.device(0).split("/")[0] == replica_per_node.device(1).split("/")[0]
    assert replica_per_node.p2p_time(0, 1, 1e8) < megatron.p2p_time(0, 1, 1e8)


def test_setup_errors_are_one_line() -> None:
    topology, _ = cluster_topology("a100-80gb", nodes=1, gpus_per_node=4)
    with pytest.raises(ConfigError, match="= 8 devices, but the cluster has 4"):
        model_setup(GPT, topology, Mesh(tp=2, pp=2, dp=2), build_schedule("1f1b", 2, 4))
    with pytest.raises(ConfigError, match="has 4 ranks but --pp is 2"):
        model_setup(GPT, topology, Mesh(tp=2, pp=2), build_schedule("1f1b", 4, 4))
    with pytest.raises(ConfigError, match="not a multiple of --microbatch-size 3"):
        microbatches_per_pipeline(64, 3, 2)
    with pytest.raises(ConfigError, match="needs --gpu"):
        cluster_topology(None)
    assert unit_setup(build_schedule("1f1b", 2, 4)).simulate().iteration_time == 15.0
