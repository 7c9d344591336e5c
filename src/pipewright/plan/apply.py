"""Apply a plan file to the RunSpec of ``pipewright simulate`` (``pipewright train``'s:
:mod:`pipewright.training.plan_values`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER, Mesh
from pipewright.plan.mapping import placement
from pipewright.plan.planfile import CHOSEN, load
from pipewright.plan.request import PlanOverrides
from pipewright.plan.spec_inputs import FRAMEWORK_DEFAULTABLE
from pipewright.runspec import RunSpec, with_values
from pipewright.topology import Topology

Path = tuple[str, ...]


#: The cost-model inputs a plan was priced with that ``simulate`` takes where the spec leaves them
#: neutral (a flag given overrides the plan): path → the spec's neutral value.
_PRICED: dict[Path, object] = {
    ("framework", "attention"): "eager",
    ("parallelism", "cp"): 1,
    ("parallelism", "ep"): 1,
    ("memory", "shard_optimizer"): False,
    ("memory", "fsdp"): False,
    ("framework", "tp_comm_overlap"): False,
    **dict.fromkeys(
        [
            ("cluster", "calibration"),
            ("schedule", "microbatch_group"),
            ("memory", "recompute_method"),
            ("memory", "recompute_num_layers"),
            ("framework", "name"),
            *FRAMEWORK_DEFAULTABLE.values(),
        ]
    ),
}
#: What ``simulate`` takes from the plan where the spec leaves it unset: the vocabulary it priced and
#: the gradient reduction of its iteration (the model too, without a model in the spec).
_UNSET: tuple[Path, ...] = (("model", "vocab"), ("framework", "grad_reduce"))
#: What ``simulate`` takes from the plan's data instead of the spec (:class:`PlanOverrides`): the layers
#: per chunk, the device of each rank.
_OVERRIDDEN: tuple[Path, ...] = (("parallelism", "layout"), ("parallelism", "placement"))


def simulate_plan(spec: RunSpec) -> tuple[RunSpec, PlanOverrides]:
    """``spec`` with the plan file it names (``parallelism.plan``) applied, as ``pipewright simulate``
    prices it (:meth:`~pipewright.plan.planfile.Plan.spec_values`), and the plan's data beyond the spec
    (device order, layers per chunk, recomputation per stage). The plan's choices (its schedule, a
    generated one's CSV, batch, sizes) replace the spec's; the model, the gradient reduction and the
    cost-model inputs the plan was priced with hold where the spec leaves them unset (a flag given
    overrides the plan)."""
    path = spec.parallelism.plan
    plan = load(path)
    plan_values = plan.spec_values(path)
    changes = {p: plan_values[p] for p in _UNSET if _get(spec, p) is None}
    if spec.model.model is None:  # the plan's model, with the dimensions it records
        model = {p: v for p, v in plan_values.items() if p[0] == "model" and p not in changes}
        changes |= {
            p: v for p, v in model.items() if v not in (None, False) and _get(spec, p) in (None, False)
        }
    changes |= {
        p: plan_values[p] for p, neutral in _PRICED.items() if _get(spec, p) in (None, False, neutral)
    }
    taken = {*_PRICED, *_UNSET, *_OVERRIDDEN}
    changes |= {p: plan_values[p] for p in CHOSEN if p not in taken}
    if plan.schedule_csv(path) is not None:  # the generated order gives the chunks
        changes[("parallelism", "virtual")] = None
    recompute = plan.data.get("recompute_per_stage")
    return with_values(spec, changes), PlanOverrides(
        plan,
        layout=plan.chunk_layers(),
        recompute=tuple(recompute) if recompute is not None else None,
        devices=tuple(plan.devices) if plan.devices is not None else None,
    )


def _get(spec: RunSpec, path: Path) -> object:
    section, name = path
    return getattr(getattr(spec, section), name)


def plan_placement(devices: Sequence[str], topology: Topology) -> tuple[int, ...]:
    """The index into ``topology.devices`` of each global rank's device (the plan's ``devices``, in the
    mesh's default rank order): a :class:`~pipewright.mesh.Mesh` placement. One-line error when the
    topology lacks one of them or has other devices besides (a plan places every device)."""
    missing = [d for d in devices if d not in topology.nodes or not topology.nodes[d].is_device]
    if missing:
        raise ConfigError(
            f"the plan assigns device {missing[0]!r}, which topology {topology.name} does not have; "
            "give the --topology (or --nodes/--gpus-per-node/--gpu) the plan was made for"
        )
    if len(devices) != len(topology.devices):
        raise ConfigError(
            f"the plan places {len(devices)} devices, topology {topology.name} has "
            f"{len(topology.devices)}; give the topology the plan was made for"
        )
    return placement(topology, devices)


def placed(mesh: Mesh, placement: Sequence[int] | None) -> Mesh:
    """``mesh`` with a plan's ``placement`` (device of each rank in the default ``tp-dp-pp`` order)
    carried over to ``mesh``'s own rank order: every (tp, pp, dp) coordinate keeps the plan's device."""
    if placement is None:
        return mesh
    plan_order = Mesh(mesh.tp, mesh.pp, mesh.dp, DEFAULT_ORDER, cp=mesh.cp)
    if len(placement) != mesh.size:
        raise ConfigError(
            f"the plan places {len(placement)} ranks, but tp {mesh.tp} × cp {mesh.cp} × pp {mesh.pp} × "
            f"dp {mesh.dp} = {mesh.size}; drop the --tp/--cp/--pp/--dp flags that override the plan"
        )
    own = [0] * mesh.size
    for g, device in enumerate(placement):
        own[mesh.rank(**plan_order.coords(g)._asdict())] = device
    return replace(mesh, placement=tuple(own))


def plan_mesh(devices: Sequence[str] | None, topology: Topology, mesh: Mesh) -> Mesh:
    """``pipewright simulate --plan``: ``mesh`` placed on the plan's ``devices`` (unchanged without a
    plan, or for a plan that names no devices: the devices in the given order)."""
    if not devices:
        return mesh
    return placed(mesh, plan_placement(devices, topology))
