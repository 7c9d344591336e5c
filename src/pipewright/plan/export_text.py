"""The export of a plan for a trainer named by ``--to`` (:data:`TARGETS`): each target's text
function, by name."""

from __future__ import annotations

from collections.abc import Callable

from pipewright.errors import ConfigError
from pipewright.plan.export_bridge import bridge_text
from pipewright.plan.export_megatron import megatron_text
from pipewright.plan.export_torchtitan import torchtitan_text
from pipewright.plan.export_torchtitan_args import torchtitan_args_text
from pipewright.plan.planfile import Plan

#: target → its text: (plan, source, schedule CSV path or None) → the file's text.
WRITERS: dict[str, Callable[[Plan, str, str | None], str]] = {
    "megatron": lambda plan, source, _csv: megatron_text(plan, source),
    "torchtitan": torchtitan_text,
    "torchtitan-0.3": torchtitan_args_text,
    "bridge": lambda plan, source, _csv: bridge_text(plan, source),
}
#: The trainers a plan exports to.
TARGETS = tuple(WRITERS)


def export_text(plan: Plan, target: str, source: str = "plan", schedule_csv: str | None = None) -> str:
    """The plan for ``target``; one-line error naming the targets for another."""
    if target not in WRITERS:
        raise ConfigError(f"--to {target!r}: choose one of {', '.join(TARGETS)}")
    return WRITERS[target](plan, source, schedule_csv)
