"""Megatron-LM Table 1 predicted through the one simulation-setup path.

Each row of :data:`pipewright.cost.megatron.TABLE1` becomes a :class:`~pipewright.plan.setup.SimSetup`
by :func:`~pipewright.plan.setup.model_setup` — exactly what ``pipewright simulate --model …`` builds
from :func:`table1_arguments` — on a Selene-like cluster (:func:`~pipewright.plan.setup.cluster_topology`
of ``gpus / 8`` DGX A100 80GB nodes, one HDR NIC per GPU), fp16, full recomputation, Megatron's
tp-dp-pp rank order and the gradient all-reduce after the pipeline drains (the paper's runs did not
overlap it). TFLOP/s per GPU = :func:`~pipewright.cost.transformer.megatron_flops_per_iteration` /
(iteration time × GPUs), the paper's own accounting; the iteration time comes from the simulator
(:func:`simulated_iteration_time`) or Megatron's closed form
(:func:`~pipewright.cost.megatron.closed_form_iteration_time`).
"""

from __future__ import annotations

from collections.abc import Callable

from pipewright.cost.base import CommModel, CostModel
from pipewright.cost.megatron import GPUS_PER_NODE, Table1Row
from pipewright.cost.transformer import (
    A100_EFFICIENCY,
    Efficiency,
    TransformerCost,
    megatron_flops_per_iteration,
)
from pipewright.ir import Schedule
from pipewright.mesh import Mesh
from pipewright.plan.setup import SimSetup, cluster_topology, model_setup
from pipewright.schedules.registry import build_schedule
from pipewright.sim.engine import simulate

GPU = "a100-80gb"


def table1_schedule_name(row: Table1Row) -> str:
    """ "1f1b", or "interleaved-1f1b" where the row has v > 1 chunks per rank."""
    return "1f1b" if row.virtual_chunks == 1 else "interleaved-1f1b"


def table1_setup(row: Table1Row, efficiency: Efficiency = A100_EFFICIENCY) -> SimSetup:
    """The row's setup (module docstring): its schedule with REDUCE_GRAD appended, the analytical cost
    and the topology's comm model."""
    topology, gpu = cluster_topology(GPU, row.gpus // GPUS_PER_NODE, GPUS_PER_NODE)
    schedule = build_schedule(table1_schedule_name(row), row.pp, row.microbatches, row.virtual_chunks)
    return model_setup(
        row.spec(),
        topology,
        Mesh(tp=row.tp, pp=row.pp, dp=row.dp),
        schedule,
        row.microbatch,
        gpu=gpu,
        dtype="fp16",
        recompute="full",
        efficiency=efficiency,
        grad_reduce="after",
        attention="eager",
    )


def table1_arguments(row: Table1Row) -> list[str]:
    """The ``pipewright simulate`` arguments that build :func:`table1_setup` of ``row``."""
    return [
        "simulate", "--model", row.name, "--gpu", GPU,
        "--nodes", str(row.gpus // GPUS_PER_NODE), "--gpus-per-node", str(GPUS_PER_NODE),
        "--tp", str(row.tp), "--pp", str(row.pp), "--dp", str(row.dp), "--virtual", str(row.virtual_chunks),
        "--microbatch-size", str(row.microbatch), "--global-batch-size", str(row.global_batch),
        "--schedule", table1_schedule_name(row), "--recompute", "full", "--dtype", "fp16",
        "--grad-reduce", "after", "--attention", "eager",
    ]  # fmt: skip


def table1_cost(row: Table1Row, efficiency: Efficiency = A100_EFFICIENCY) -> TransformerCost:
    """The analytical cost model of one row (:func:`table1_setup`'s)."""
    cost = table1_setup(row, efficiency).cost
    assert isinstance(cost, TransformerCost)
    return cost


IterationTime = Callable[[Schedule, CostModel, CommModel], float]


def simulated_iteration_time(schedule: Schedule, cost: CostModel, comm: CommModel) -> float:
    """The discrete-event simulator's iteration time (one iteration, optimizer step behind a barrier)."""
    return simulate(schedule, cost, comm=comm, iterations=1, step_barrier=True).iteration_time


def predict_table1_row(
    row: Table1Row,
    efficiency: Efficiency = A100_EFFICIENCY,
    iteration_time: IterationTime | None = None,
) -> float:
    """Predicted TFLOP/s per GPU of ``row`` = Megatron's FLOPs per iteration / (iteration time × GPUs).

    ``iteration_time``: the discrete-event simulator by default (:func:`simulated_iteration_time`), or
    :func:`~pipewright.cost.megatron.closed_form_iteration_time`."""
    setup = table1_setup(row, efficiency)
    seconds = (iteration_time or simulated_iteration_time)(setup.schedule, setup.cost, setup.comm)
    flops = megatron_flops_per_iteration(row.spec(), row.global_batch, "full")
    return flops / (seconds * row.gpus) / 1e12
