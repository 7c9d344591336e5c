"""Apply a plan file to the RunSpec of ``pipewright simulate`` (``pipewright train``'s:
:mod:`pipewright.training.plan_values`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER, Mesh
from pipewright.plan.mapping import placement
from pipewright.plan.planfile import Plan, load
from pipewright.plan.request import PlanOverrides
from pipewright.plan.spec_inputs import FRAMEWORK_DEFAULTABLE
from pipewright.runspec import RunSpec, with_values
from pipewright.topology import Topology

Path = tuple[str, ...]


def simulate_plan(spec: RunSpec) -> tuple[RunSpec, PlanOverrides]:
    """``spec`` with the plan file it names (``parallelism.plan``) applied, as ``pipewright simulate``
    prices it, and the plan's data beyond the spec (device order, layers per chunk, recomputation per
    stage). The plan's layout, schedule and batch replace the spec's; the model, the gradient
    reduction and the cost-model inputs the plan was priced with hold where the spec leaves them unset
    (a flag given overrides the plan)."""
    path = spec.parallelism.plan
    plan = load(path)
    changes = {p: v for p, v in _unset(spec, plan).items() if _get(spec, p) is None}
    changes |= {p: v for p, (neutral, v) in _priced(plan).items() if _get(spec, p) in (None, False, neutral)}
    changes |= _chosen(plan, path)
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


def _unset(spec: RunSpec, plan: Plan) -> dict[Path, object]:
    """What the plan sets where the spec leaves it unset: the vocabulary it priced, the gradient
    reduction of its iteration, and without a model in the spec, the plan's model."""
    out: dict[Path, object] = {
        ("model", "vocab"): plan.padded_vocab,
        ("framework", "grad_reduce"): plan.grad_reduce,
    }
    if spec.model.model is not None:
        return out
    model = plan["model"]
    out[("model", "model")] = model["name"]
    for d in ("layers", "hidden", "heads", "ffn_hidden", "seq_len", "kv_heads", "mlp"):
        if d in model:
            out[("model", d)] = model[d]
    if model.get("bias") is False:
        out[("model", "no_bias")] = True
    return out


def _priced(plan: Plan) -> dict[Path, tuple[object, object]]:
    """The cost-model inputs the plan was priced with: path → (the spec's neutral value, the plan's)."""
    d = plan.data
    sharding, overlap = d.get("optimizer_sharding", "none"), plan.tp_comm_overlap
    return {
        ("framework", "attention"): ("eager", d.get("attention", "eager")),
        ("parallelism", "cp"): (1, d.get("cp", 1)),
        ("parallelism", "ep"): (1, d.get("ep", 1)),
        ("memory", "shard_optimizer"): (False, sharding == "zero1"),
        ("memory", "fsdp"): (False, sharding == "fsdp"),
        ("framework", "tp_comm_overlap"): (False, False if overlap == "none" else overlap),
        ("cluster", "calibration"): (None, d.get("calibration")),
        ("schedule", "microbatch_group"): (None, plan.microbatch_group),
        ("memory", "recompute_method"): (None, d.get("recompute_method")),
        ("memory", "recompute_num_layers"): (None, d.get("recompute_num_layers")),
        ("framework", "name"): (None, plan.framework_input("framework")),
        **{path: (None, plan.framework_input(key)) for key, path in FRAMEWORK_DEFAULTABLE.items()},
    }


def _chosen(plan: Plan, path: str) -> dict[Path, object]:
    """What the plan chose (:meth:`~pipewright.plan.planfile.Plan.chosen`; the schedule's CSV when it
    has one) and its recomputation (per stage: the plan's data)."""
    out = {**plan.chosen(), ("memory", "recompute"): plan["recompute"]}
    csv = plan.schedule_csv(path)
    if csv is not None:
        out |= {("schedule", "name"): csv, ("parallelism", "virtual"): None}
    return out


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
