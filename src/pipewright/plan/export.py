"""A plan as the arguments of another trainer: what the targets share and the dispatch by target.

Each export describes the whole model the plan priced (plan/export_model.py) and the plan's layout
(models/layout.py: ``E`` the embedding, ``t`` a transformer layer, ``L`` the output layer and loss,
``|`` between chunks, chunk c of the whole model in order). The targets:

- ``megatron``: Megatron-LM's command-line arguments (plan/export_megatron.py);
- ``bridge``: a Megatron-Bridge 0.3.1 recipe override, Python (plan/export_bridge.py);
- ``torchtitan``: torchtitan 0.2.2's TOML job config (plan/export_torchtitan.py);
- ``torchtitan-0.3``: torchtitan 0.3.0's command line (plan/export_torchtitan_args.py);

and ``export_text`` (plan/export_text.py) the one to call by target name.

What a target cannot express is refused (a V-shaped placement for Megatron-LM) or written as a
``# note:`` line, never dropped silently.

Pure Python: the plan file and the schedule registry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.plan.planfile import Plan

#: pipewright schedule → PyTorch's schedule class (``torch.distributed.pipelining.get_schedule_class``).
TORCH_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "1f1b-overlap": "1F1B",  # the same order; torchtitan runs the pairs one after the other
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "zbv": "ZBVZeroBubble",
    "zbv-torch": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: Schedules whose chunks sit in a V (rank r holds chunks r and 2p − 1 − r), not round robin.
V_SHAPED = ("zbv", "zbv-torch", "dualpipev", "v-half", "v-min")
_NAMES = {"megatron": "Megatron-LM"}
#: Megatron-LM's schedule for v = 1 and v > 1.
_MEGATRON_SCHEDULE = {1: "1f1b"}


@dataclass(frozen=True)
class Chunk:
    """One model chunk of the plan: whether it holds the embedding and the output layer, and its
    transformer layers (global indices)."""

    embedding: bool
    layers: tuple[int, ...]
    output: bool


def chunks(plan: Plan) -> tuple[Chunk, ...]:
    """The plan's model chunks in model order, from its layout string."""
    from pipewright.models.layout import parse_layout

    out, first = [], 0
    for stage in parse_layout(plan.layout).stages:
        n = len(stage.layers)
        out.append(Chunk(stage.embedding, tuple(range(first, first + n)), stage.head))
        first += n
    return tuple(out)


def is_uniform(parts: Sequence[Chunk]) -> bool:
    """Equal layer counts, the embedding on the first chunk and the output layer on the last only."""
    counts = {len(c.layers) for c in parts}
    ends = parts[0].embedding and parts[-1].output
    inner = not any(c.embedding for c in parts[1:]) and not any(c.output for c in parts[:-1])
    return len(counts) == 1 and counts != {0} and ends and inner


def recompute_setting(plan: Plan) -> tuple[str, bool]:
    """The run's recomputation (the strongest any stage uses: the spec's ``memory.recompute``,
    :meth:`~pipewright.plan.planfile.Plan.spec_values`) and whether the stages differ."""
    strongest = plan.spec_values()[("memory", "recompute")]
    return strongest, len(set(plan.data.get("recompute_per_stage") or ())) > 1


def notes(plan: Plan, target: str) -> list[str]:
    """What the target runs differently from the plan, for every target: schedule, tensor-parallel
    overlap, per-stage recomputation (each target's module adds its own)."""
    out = []
    name, v = plan["schedule"], int(plan.data.get("virtual", 1))
    if target == "megatron":
        runs = _MEGATRON_SCHEDULE.get(v, "interleaved-1f1b")
        if name != runs:
            out.append(
                f"the plan's schedule is {name}; Megatron-LM runs {runs} with these chunks, so its "
                "iteration differs from the plan's prediction"
            )
    else:
        if name not in TORCH_SCHEDULES:
            out.append(
                f"the plan's schedule {name} has no PyTorch class: its order is given as a schedule CSV"
            )
        if plan.data.get("optimizer_sharding") == "zero1" and int(plan["dp"]) > 1:
            out.append(
                "torchtitan shards weights, gradients and optimizer state over data parallelism (FSDP); "
                "the plan shards only the optimizer state (ZeRO-1)"
            )
    overlap = _target_tp_overlap(target)
    if plan.tp_comm_overlap not in ("none", overlap):
        out.append(
            f"the plan prices --tp-comm-overlap {plan.tp_comm_overlap}; {target} overlaps tensor-parallel "
            f"communication its own way ({overlap}), so its iteration differs from the plan's prediction"
        )
    recompute, mixed = recompute_setting(plan)
    if recompute == "op" and target == "megatron":
        out.append(
            "the plan recomputes with torchtitan's operator-level policy (op); Megatron-LM has no such "
            "policy and runs selective recomputation (the attention core) instead"
        )
    method = plan.data.get("recompute_method")
    if method and recompute == "full" and target != "megatron":
        out.append(
            f"the plan recomputes with Megatron-LM's --recompute-method {method} "
            f"--recompute-num-layers {plan.data.get('recompute_num_layers') or 1}; torchtitan's full "
            "activation checkpointing wraps every block"
        )
    if mixed:
        per = ",".join(plan.data["recompute_per_stage"])
        out.append(f"recomputation differs per stage ({per}); both trainers take one setting: {recompute}")
    place = plan.placement
    if place is not None and list(place) != sorted(place):
        shown = ",".join(map(str, place[:16])) + ("," if len(place) > 16 else "")
        out.append(
            f"the plan places global rank g (order tp-dp-pp) on device placement[g] = {shown}"
            f"{'…' if len(place) > 16 else ''} of its device list; {_NAMES.get(target, target)} numbers "
            "ranks in the launch "
            'order, so launch rank g on that device (the plan file\'s "placement" and "devices")'
        )
    return out


def _target_tp_overlap(target: str) -> str | None:
    """The ``--tp-comm-overlap`` mode ``target`` runs: the framework of that name's
    (:attr:`pipewright.cost.frameworks.Framework.tp_overlap`)."""
    from pipewright.cost.frameworks import framework

    return framework(target).tp_overlap


def summary(plan: Plan) -> str:
    return (
        f"{plan['model'].get('name', 'model')}, tp {plan['tp']} cp {plan.data.get('cp', 1)} pp {plan['pp']} "
        f"dp {plan['dp']} v {plan.data.get('virtual', 1)}, {plan['schedule']}, layout {plan.layout}"
    )
