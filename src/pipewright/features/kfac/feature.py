"""The K-FAC feature bundle (:class:`pipewright.features.Feature`): kinds, cost rules, the runtime's
slot pass, the training options and plugin (:mod:`.train`), and the ``simulate`` options. Pure Python
(the plugin is imported lazily by name)."""

from __future__ import annotations

from pipewright.cost.rules import ActionCost
from pipewright.features import Feature
from pipewright.features.kfac.cost import (
    KFACCost,
    LinearShape,
    TaskTimes,
    block_layers,
)
from pipewright.features.kfac.fill import slot_schedule
from pipewright.features.kfac.kinds import KFAC_REDUCE, KFAC_SPECS
from pipewright.features.kfac.options import KfacOptions
from pipewright.ir import Action, Schedule


def task_times_for(base, schedule: Schedule) -> TaskTimes:
    """K-FAC task times for ``base``'s model: a PipeFisher profile's block times (split over the
    block's linears), the model's FLOPs at half the accelerator's fp32 peak (``TransformerCost``), or
    1 per task for unit costs (one layer per chunk)."""
    n = schedule.num_stages
    if hasattr(base, "composition") and base.time("layer", "KFAC_KRON") > 0:
        hidden = {"bert-base": 768, "opt-125m": 768}.get(base.meta.get("model", ""), 1024)
        blocks = [base.composition(s, schedule)["layer"] for s in range(n)]
        return TaskTimes.from_block_profile(
            blocks,
            block_layers(hidden, 4 * hidden),
            base.time("layer", "KFAC_KRON"),
            base.time("layer", "KFAC_INV"),
            base.time("layer", "KFAC_PREC"),
        )
    if hasattr(base, "spec") and hasattr(base, "layers_of"):
        from pipewright.hardware import accelerator

        spec = base.spec
        rate = 0.5 * accelerator(base.gpu).peak("fp32")
        shapes = [block_layers(spec.hidden, spec.ffn_hidden) * c for c in base.layers_of(schedule)]
        return TaskTimes.from_flops(shapes, base.microbatch * spec.seq_len, rate)
    one = (LinearShape(1, 1),)
    return TaskTimes((one,) * n, (((1.0, 1.0),),) * n, (((1.0, 1.0),),) * n, (1.0,) * n)


def kfac_cost_rule(action: Action, schedule: Schedule, base) -> ActionCost:
    """Cost rule of every K-FAC kind (see :mod:`.cost`)."""
    cost = KFACCost(base, task_times_for(base, schedule))
    if action.kind == KFAC_REDUCE:
        return ActionCost(message_bytes=cost.message_bytes(action, schedule))
    return ActionCost(time=cost.compute_time(action, schedule))


def _options(command: str, parser) -> None:
    if command == "simulate":
        from pipewright.features.kfac.cli import add_arguments

        add_arguments(parser)


def _slot_pass(schedule: Schedule, **_: object) -> Schedule:
    return slot_schedule(schedule)[0]


FEATURE = Feature(
    name="kfac",
    kinds=KFAC_SPECS,
    cost_rules={spec.name: kfac_cost_rule for spec in KFAC_SPECS},
    passes={"kfac-slots": _slot_pass},
    options=_options,
    simulate="pipewright.features.kfac.cli:simulate_hook",
    section=KfacOptions,
    plugin="pipewright.features.kfac.train:KfacPlugin",
    description="PipeFisher: K-FAC curvature, inversion and preconditioning in the pipeline bubbles",
)
