"""One place that builds a simulation setup — schedule, cost model, comm model, core sharing — from a
model, a cluster and a layout. ``pipewright simulate``, ``pipewright train --compare-sim``, Megatron
Table 1 (:mod:`pipewright.plan.table1`) and the planner all call these builders, so a configuration is
priced the same way wherever it is described.

- :func:`unit_setup`: unit costs (F = 1, B = 2, I = W = 1), free communication.
- :func:`model_setup`: the analytical cost of a :class:`~pipewright.models.spec.ModelSpec`
  (:class:`~pipewright.cost.transformer.TransformerCost`, or ``LlamaCost`` for Llama models) on a
  topology, ranks placed by a :class:`~pipewright.mesh.Mesh`; with dp × cp > 1 the gradient all-reduce is
  added (``grad_reduce``: "after" the pipeline drains, Megatron-LM's default, or "overlap"ped with the
  remaining backward).
- :func:`profile_setup`: measured costs (:class:`~pipewright.cost.profiled.ProfiledCost`) from a
  ``pipewright profile`` table, the profiled boundary-message time for p2p and a single host's
  loopback for the data-parallel all-reduce (the gradient reduction overlapped, as the executor runs it).

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.cost.unit import UnitCost
from pipewright.errors import ConfigError
from pipewright.ir import Action, Schedule
from pipewright.sim.engine import SimResult, simulate

if TYPE_CHECKING:
    from pipewright.cost.calibration import Calibration
    from pipewright.cost.profiled import ProfileRow
    from pipewright.cost.transformer import Efficiency
    from pipewright.hardware import Accelerator
    from pipewright.mesh import Mesh
    from pipewright.models.layout import Layout
    from pipewright.models.spec import ModelSpec
    from pipewright.sim.sharing import SharedCompute
    from pipewright.topology import Topology

# The cost models, cluster descriptions and layouts are imported inside the functions that use them:
# a unit-cost ``pipewright simulate`` imports this module and needs none of them.

#: Unit costs read one time unit of compute as 10¹² FLOPs and a device's peak as 10¹² FLOPs per time
#: unit, so "TFLOP/s per device" and MFU both read as the fraction of time a device computes.
UNIT_PEAK = 1e12


class UnitWork(UnitCost):
    """Unit costs whose FLOPs are their compute time × 10¹² (see :data:`UNIT_PEAK`)."""

    def flops(self, action: Action, schedule: Schedule) -> float:
        return self.compute_time(action, schedule) * UNIT_PEAK

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        return self.compute_time(action, schedule) * UNIT_PEAK


@dataclass(frozen=True)
class SimSetup:
    """Everything one simulation needs, however it was described.

    ``devices_per_rank``: devices a simulated rank's FLOPs are spread over (1: the cost model reports
    one device's share). ``peak_flops``/``memory_limit``: one device's, for MFU and the fit check.
    ``unit``: times are unit costs (else seconds). ``shared``: processor sharing of the ranks' compute.
    """

    schedule: Schedule
    cost: CostModel
    comm: CommModel
    devices_per_rank: int = 1
    peak_flops: float | None = None
    memory_limit: float | None = None
    label: str = ""
    unit: bool = False
    shared: SharedCompute | None = None

    def simulate(self, iterations: int = 1, step_barrier: bool = True, validate: bool = False) -> SimResult:
        """:func:`pipewright.sim.simulate` of this setup (``validate``: validate the lowered schedule
        first, sharing the dependency resolution with the simulation)."""
        return simulate(
            self.schedule,
            self.cost,
            comm=self.comm,
            iterations=iterations,
            step_barrier=step_barrier,
            shared=self.shared,
            validate=validate,
        )


def unit_setup(schedule: Schedule) -> SimSetup:
    """Unit costs, free communication; activation 1/v per chunk-microbatch (peak memory reads in
    microbatches of a rank's layers)."""
    cost = UnitWork(per_chunk=True, activation=1 / schedule.chunks_per_rank)
    return SimSetup(schedule, cost, FreeComm(), 1, UNIT_PEAK, None, "cost unit", unit=True)


def cluster_topology(
    gpu: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 8,
    topology: str | Topology | None = None,
    nics_per_node: int | None = None,
) -> tuple[Topology, Accelerator]:
    """The cluster and its accelerator: ``topology`` (a Topology or a JSON file; ``gpu`` overrides its
    accelerator for pricing), else ``nodes`` × ``gpus_per_node`` of ``gpu`` (NVLink inside a node where
    the GPU has it, else PCIe 4; InfiniBand HDR between nodes, one NIC per GPU by default; ``cpu``: one
    host on gloo loopback)."""
    from pipewright.hardware import accelerator
    from pipewright.topology import Topology, cluster, single_host

    if topology is not None:
        topo = Topology.load(topology) if isinstance(topology, str) else topology
        return topo, accelerator(gpu) if gpu else topo.accelerator(0)
    if not gpu:
        raise ConfigError("--model needs --gpu KIND (or --topology FILE)")
    acc = accelerator(gpu)
    if acc.name == "cpu":
        return single_host(nodes * gpus_per_node), acc
    intra = "nvlink" if acc.nvlink else "pcie4"
    return cluster(nodes, gpus_per_node, acc.name, intra=intra, nics_per_node=nics_per_node), acc


def microbatches_per_pipeline(global_batch: int, microbatch: int, dp: int) -> int:
    """m = global batch / (microbatch size × dp); one-line error unless it divides."""
    if global_batch % (microbatch * dp):
        raise ConfigError(
            f"--global-batch-size {global_batch} is not a multiple of "
            f"--microbatch-size {microbatch} × --dp {dp}"
        )
    return global_batch // (microbatch * dp)


def default_dtype(acc: Accelerator) -> str:
    """bf16 where the accelerator has it, else fp16, else fp32."""
    return next((x for x in ("bf16", "fp16", "fp32") if x in acc.peak_flops), "fp32")


def _layout(
    layout: str | Layout | Sequence[int] | None, layers: int, stages: int
) -> Layout | tuple[int, ...] | None:
    """A layout string parsed and checked into a Layout (it also places the embedding and the output
    layer), a Layout checked, a count tuple as given, or None (uniform)."""
    from pipewright.models.layout import Layout, resolve_layout

    if layout is None or layout == "":
        return None
    if isinstance(layout, (str, Layout)):
        return resolve_layout(layout, layers, stages)
    return tuple(layout)


def _checked_mesh(mesh: Mesh, schedule: Schedule, topology: Topology) -> Mesh:
    """``mesh``, once its pipeline size is the schedule's ranks and its size the topology's devices
    (one-line ConfigError otherwise)."""
    if schedule.num_ranks != mesh.pp:
        raise ConfigError(f"schedule {schedule.name} has {schedule.num_ranks} ranks but --pp is {mesh.pp}")
    devices = len(topology.devices)
    if mesh.size != devices:
        raise ConfigError(
            f"--tp {mesh.tp} × --pp {mesh.pp} × --dp {mesh.dp}{f' × --cp {mesh.cp}' if mesh.cp > 1 else ''} "
            f"= {mesh.size} devices, but the cluster has "
            f"{devices}; make the product equal the number of GPUs"
        )
    return mesh


def model_setup(
    spec: ModelSpec,
    topology: Topology,
    mesh: Mesh,
    schedule: Schedule,
    microbatch: int = 1,
    *,
    gpu: str | Accelerator | None = None,
    dtype: str | None = None,
    recompute: str = "none",
    efficiency: Efficiency | None = None,
    grad_reduce: str = "after",
    layout: str | Layout | Sequence[int] | None = None,
    sequence_parallel: bool = False,
    per_stage_recompute: Sequence[str] | None = None,
    attention: str = "flash",
    cp: int = 1,
    optimizer_sharding: str = "none",
    tp_comm_overlap: bool = False,
    calibration: Calibration | None = None,
    attention_kernel: str | None = None,
    moe_imbalance: float = 1.0,
    **fields: object,
) -> SimSetup:
    """The analytical cost of ``spec`` on ``topology`` with ranks placed by ``mesh`` (module docstring).

    ``schedule``: compute-only, with ``mesh.pp`` ranks; REDUCE_GRAD actions are added when dp × cp > 1 (where
    ``grad_reduce`` says, unless it has them). ``gpu``: the accelerator priced (default: the topology's
    first device's); ``dtype``: default bf16 where it has it. FLOPs are per device (each tensor-parallel
    rank's share): one device per simulated rank. ``recompute``: none, selective or full
    (``per_stage_recompute``: one mode per stage, a plan's); ``sequence_parallel`` with tp > 1.
    ``efficiency``: default the accelerator's calibration defaults with wave quantisation
    (:func:`~pipewright.cost.transformer.default_efficiency`). ``attention`` (flash or eager), ``cp``
    (context parallelism; or the mesh's cp), ``optimizer_sharding`` (none, zero1, fsdp),
    ``tp_comm_overlap``, ``attention_kernel`` (fa2, fa3, cudnn) and ``calibration`` (a measured one,
    :mod:`pipewright.cost.calibration`): the cost model's fields; ``fields``: any other of them
    (``grad_dtype``).
    """
    from pipewright.cost.llama import cost_class
    from pipewright.cost.recompute import make_cost
    from pipewright.cost.sharding import reduction_bytes
    from pipewright.cost.transformer import default_efficiency
    from pipewright.hardware import Accelerator, accelerator

    mesh = _checked_mesh(replace(mesh, cp=cp) if cp > 1 and mesh.cp == 1 else mesh, schedule, topology)
    acc = gpu if isinstance(gpu, Accelerator) else accelerator(gpu) if gpu else topology.accelerator(0)
    schedule = _step_actions(schedule, mesh.dp * mesh.cp, grad_reduce, efficiency or default_efficiency(acc))
    overlapped, grad_dtype = grad_reduce == "overlap", str(fields.get("grad_dtype", "fp32"))
    grad_bytes = reduction_bytes(optimizer_sharding, grad_dtype, dtype or default_dtype(acc), overlapped)
    fields = {"grad_bytes": grad_bytes, **fields}
    cost = make_cost(
        recompute,
        cls=cost_class(spec),
        per_stage=per_stage_recompute,
        spec=spec,
        microbatch=microbatch,
        gpu=acc.name,
        dtype=dtype or default_dtype(acc),
        mesh=mesh,
        sequence_parallel=sequence_parallel,
        topology=topology,
        efficiency=efficiency or default_efficiency(acc),
        layout=_layout(layout, spec.layers, schedule.num_stages),
        attention=attention,
        cp=mesh.cp,
        optimizer_sharding=optimizer_sharding,
        tp_comm_overlap=tp_comm_overlap,
        calibration=calibration,
        **({"attention_kernel": attention_kernel} if attention_kernel else {}),
        **({"moe_imbalance": moe_imbalance} if spec.is_moe else {}),
        **fields,
    )
    from pipewright.sim.pair_overlap import with_pair_overlap  # DualPipe: all-to-all under F&B pairs

    cost = with_pair_overlap(cost, schedule)
    label = _label(spec.name, acc.name, mesh, microbatch, schedule.num_microbatches)
    return SimSetup(schedule, cost, cost.comm, 1, acc.peak(cost.dtype), acc.memory_bytes, label)


def _step_actions(schedule: Schedule, replicas: int, grad_reduce: str, efficiency: Efficiency) -> Schedule:
    """``schedule`` with its gradient reductions (over the ``replicas`` = dp × cp copies of each stage's
    weights, as Megatron-LM and the runtime reduce them: when there is more than one, where
    ``grad_reduce`` says) and its optimizer step (where ``efficiency`` prices one)."""
    from pipewright.passes.grad_reduce import append_optimizer_step, with_grad_reduction

    if replicas > 1:
        schedule = with_grad_reduction(schedule, grad_reduce)
    if efficiency.optimizer_bytes > 0:  # its optimizer step priced
        schedule = append_optimizer_step(schedule)
    return schedule


def _label(model: str, gpu: str, mesh: Mesh, microbatch: int, microbatches: int) -> str:
    """``gpt3-xl on 8× a100-80gb (t=2, p=2, d=2, b=1, m=16)`` (``c=`` with context parallelism)."""
    cp_label = f", c={mesh.cp}" if mesh.cp > 1 else ""
    return (
        f"{model} on {mesh.size}× {gpu} (t={mesh.tp}{cp_label}, p={mesh.pp}, d={mesh.dp}, "
        f"b={microbatch}, m={microbatches})"
    )


def profile_setup(
    rows: Sequence[ProfileRow],
    meta: Mapping[str, str],
    schedule: Schedule,
    microbatch: int,
    layers: int,
    *,
    tp: int = 1,
    dp: int = 1,
    layout: str | Layout | Sequence[int] | None = None,
    shared: SharedCompute | None = None,
    label: str = "",
) -> SimSetup:
    """Measured costs from a profile table (module docstring): ``schedule`` with ``pp`` ranks, REDUCE_GRAD
    overlapped (as the executor adds it) when dp > 1; the data-parallel all-reduce over one host's
    ``tp × pp × dp`` processes."""
    from pipewright.cost.comm import TopologyComm
    from pipewright.cost.profiled import ProfiledComm, ProfiledCost
    from pipewright.mesh import Mesh
    from pipewright.passes.grad_reduce import with_grad_reduction
    from pipewright.topology import single_host

    if dp > 1:
        schedule = with_grad_reduction(schedule, "overlap")
    cost = ProfiledCost(
        tuple(rows), microbatch, layers, layout=_layout(layout, layers, schedule.num_stages), meta=dict(meta)
    )
    mesh = Mesh(tp=tp, pp=schedule.num_ranks, dp=dp)
    comm = ProfiledComm.from_cost(cost, TopologyComm(single_host(mesh.size), mesh))
    return SimSetup(schedule, cost, comm, 1, None, None, label, shared=shared)


def core_sharing(
    num_ranks: int, cores: float | None, meta: Mapping[str, str] | None = None, processes_per_rank: int = 1
) -> SharedCompute | None:
    """``num_ranks`` simulated ranks (× ``processes_per_rank`` processes) sharing ``cores`` CPU cores of
    one host, with a profile's contention curve when ``meta`` has one; None without ``cores``."""
    from pipewright.sim.sharing import SharedCompute

    if cores is None:
        return None
    if cores <= 0:
        raise ConfigError(f"--cores must be positive (got {cores:g})")
    return SharedCompute.from_profile(num_ranks, cores, meta or {}, processes_per_rank=processes_per_rank)
