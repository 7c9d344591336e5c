"""A plan as a RunSpec TOML file (``pipewright plan -o RUN.toml``): the run the plan chose, which
``simulate``, ``train``, ``check`` and ``export-plan`` read with ``--config``, beside its search report
(the plan JSON, ``RUN.plan.json``, which ``parallelism.plan`` names). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipewright.plan.planfile import CHOSEN, Plan
from pipewright.runspec import RunSpec, defaults, dump_toml, validate, values, with_values
from pipewright.runspec.fields import COMMANDS

#: The suffix of a RunSpec file, and of the search report written beside it.
SPEC_SUFFIX, REPORT_SUFFIX = ".toml", ".plan.json"


def is_spec_path(path: str | Path) -> bool:
    """Whether ``-o``/a plan argument names a RunSpec TOML file (else a plan JSON)."""
    return Path(path).suffix == SPEC_SUFFIX


def report_path(out: str | Path) -> Path:
    """The plan JSON written for ``-o out``: ``out`` itself, or beside a ``.toml`` file its
    ``.plan.json``."""
    out = Path(out)
    return out.with_suffix(REPORT_SUFFIX) if is_spec_path(out) else out


def plan_spec(spec: RunSpec, plan: Plan, report: str) -> RunSpec:
    """``spec`` (the ``plan`` command's) with what the plan chose (:data:`~pipewright.plan.planfile.CHOSEN`
    of :meth:`~pipewright.plan.planfile.Plan.spec_values`: the sizes, schedule by name, batch, layout,
    the strongest recomputation of a per-stage choice, sharding and the vocabulary it priced);
    ``parallelism.plan`` names the search report ``report``, which holds what has no flag (the device
    of each rank, the recomputation per stage); nothing of the ``output`` and ``search`` sections (what
    ``plan`` wrote and searched: the report's)."""
    chosen = {p: v for p, v in plan.spec_values().items() if p in CHOSEN}
    base = replace(spec, output=defaults().output, search=defaults().search)
    return validate(with_values(base, chosen | {("parallelism", "plan"): report}), source="the plan")


def spec_text(spec: RunSpec) -> str:
    """``spec`` as TOML holding the values that differ from some command's default (a key left out
    is each command's default when read, which is then this value)."""
    starts = [values(defaults(command)) for command in COMMANDS]
    same = {p for p, v in values(spec).items() if all(v == s.get(p) for s in starts)}
    return dump_toml(with_values(spec, dict.fromkeys(same)))


def write_spec(spec: RunSpec, plan: Plan, out: str | Path) -> None:
    """Write the RunSpec of ``plan`` to ``out`` (a ``.toml`` file, its report beside it)."""
    Path(out).write_text(spec_text(plan_spec(spec, plan, report_path(out).name)), encoding="utf-8")
