"""The K-FAC feature bundle (:class:`pipewright.features.Feature`): kinds, cost rules, the runtime's
slot pass, the options of ``train`` and ``simulate`` (:mod:`.options`), the training plugin
(:mod:`.train`) and the simulate hook (:mod:`.cli`). Pure Python and light: the plugin and the hook are
imported by name when used, the slot pass imports the simulator when it runs, so building the command
line imports no numpy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipewright.features.bundle import Feature
from pipewright.features.kfac.kinds import KFAC_REDUCE, KFAC_SPECS
from pipewright.features.kfac.options import KfacOptions
from pipewright.ir import Action, Schedule
from pipewright.runspec.feature_registry import BUILTIN_SECTIONS

if TYPE_CHECKING:  # the cost package: imported when a rule runs
    from pipewright.cost.rules import ActionCost
    from pipewright.features.kfac.cost import TaskTimes


def task_times_for(base, schedule: Schedule) -> TaskTimes:
    """K-FAC task times for ``base``'s model: a PipeFisher profile's block times (split over the
    block's linears), the model's FLOPs at half the accelerator's fp32 peak (``TransformerCost``), or
    1 per task for unit costs (one layer per chunk)."""
    from pipewright.features.kfac.cost import LinearShape, TaskTimes, block_layers

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
    from pipewright.cost.rules import ActionCost
    from pipewright.features.kfac.cost import KFACCost

    cost = KFACCost(base, task_times_for(base, schedule))
    if action.kind == KFAC_REDUCE:
        return ActionCost(message_bytes=cost.message_bytes(action, schedule))
    return ActionCost(time=cost.compute_time(action, schedule))


def _slot_pass(schedule: Schedule, **_: object) -> Schedule:
    from pipewright.features.kfac.fill import slot_schedule  # the simulator, numpy: only when it runs

    return slot_schedule(schedule)[0]


FEATURE = Feature(
    name="kfac",
    kinds=KFAC_SPECS,
    cost_rules={spec.name: kfac_cost_rule for spec in KFAC_SPECS},
    passes={"kfac-slots": _slot_pass},
    simulate="pipewright.features.kfac.cli:simulate_hook",
    section=KfacOptions,
    plugin="pipewright.features.kfac.train:KfacPlugin",
    optimizers=("kfac",),
    description=BUILTIN_SECTIONS["kfac"].description,
)
