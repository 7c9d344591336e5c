"""Apply a plan file to the options of ``pipewright simulate`` (``pipewright train``'s:
:mod:`pipewright.training.plan_values`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER, Mesh
from pipewright.plan.mapping import placement
from pipewright.plan.planfile import FRAMEWORK_INPUTS, Plan, load
from pipewright.plan.request import PlanOverrides
from pipewright.topology import Topology

_SIM_FIELDS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "virtual": "virtual",
    "schedule": "schedule",
    "microbatch_size": "microbatch_size",
    "global_batch_size": "global_batch_size",
    "recompute": "recompute",
    "sequence_parallel": "sequence_parallel",
}


def simulate_overrides(args: argparse.Namespace) -> PlanOverrides:
    """What ``args.plan`` (a plan file) sets for ``pipewright simulate``: the layout options (the model's
    dimensions only where ``args`` leaves them unset), and the plan's device order and layers per chunk.
    ``args`` is read, not changed."""
    plan = load(args.plan)
    values: dict[str, object] = {}
    if getattr(args, "vocab", None) is None:
        values["vocab"] = plan.padded_vocab  # the vocabulary the plan was priced with
    if args.model is None:
        values["model"] = plan["model"]["name"]
        for d in ("layers", "hidden", "heads", "ffn_hidden", "seq_len", "kv_heads", "mlp"):
            if getattr(args, d, None) is None and d in plan["model"]:
                values[d] = plan["model"][d]
        if plan["model"].get("bias") is False:
            values["no_bias"] = True
    if getattr(args, "grad_reduce", None) is None:
        values["grad_reduce"] = plan.grad_reduce  # the plan's definition of an iteration
    values |= {attr: plan[key] for key, attr in _SIM_FIELDS.items()}
    for key, (attr, neutral, value) in _cost_fields(plan).items():
        if hasattr(args, attr):
            if getattr(args, attr, None) in (None, False, neutral):  # a flag given overrides the plan
                values[attr] = value
        elif value != neutral:
            raise ConfigError(
                f"the plan sets {key} ({value!r}), which this `pipewright simulate` cannot apply; "
                "plan without it"
            )
    values["microbatches"] = plan["microbatches"]  # (the model path derives it from the global batch)
    csv = plan.schedule_csv(args.plan)
    if csv is not None:
        values |= {"schedule": csv, "virtual": None}
    recompute = plan.data.get("recompute_per_stage")
    return PlanOverrides(
        plan,
        values,
        layout=plan.chunk_layers(),
        recompute=tuple(recompute) if recompute is not None else None,
        devices=tuple(plan.devices) if plan.devices is not None else None,
    )


def applied(args: argparse.Namespace, overrides: PlanOverrides) -> argparse.Namespace:
    """A copy of ``args`` with the plan's option values."""
    return argparse.Namespace(**{**vars(args), **overrides.values})


def _cost_fields(plan: Plan) -> dict[str, tuple[str, object, object]]:
    """The plan's cost-model options as ``simulate`` options: key → (attribute, neutral value, value)."""
    d = plan.data
    sharding, overlap = d.get("optimizer_sharding", "none"), plan.tp_comm_overlap
    return {
        "attention": ("attention", "eager", d.get("attention", "eager")),
        "cp": ("cp", 1, d.get("cp", 1)),
        "ep": ("ep", 1, d.get("ep", 1)),
        "zero1": ("shard_optimizer", False, sharding == "zero1"),
        "fsdp": ("fsdp", False, sharding == "fsdp"),
        "tp_comm_overlap": ("tp_comm_overlap", False, False if overlap == "none" else overlap),
        "calibration": ("calibration", None, d.get("calibration")),
        "microbatch_group": ("microbatch_group", None, plan.microbatch_group),
        "recompute_method": ("recompute_method", None, d.get("recompute_method")),
        "recompute_num_layers": ("recompute_num_layers", None, d.get("recompute_num_layers")),
        **{key: (key, None, plan.framework_input(key)) for key in FRAMEWORK_INPUTS},
    }


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
