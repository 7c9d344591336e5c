"""``pipewright export-plan PLAN --to megatron|bridge|torchtitan|torchtitan-0.3 [-o FILE]``: a plan as
Megatron-LM's flags, a Megatron-Bridge recipe override, torchtitan 0.2.2's TOML or torchtitan 0.3.0's
arguments (:mod:`pipewright.plan.export`; docs/planner.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipewright.outputs import check_output
from pipewright.plan.export import TORCH_SCHEDULES

#: File suffix of each target's output.
SUFFIX = {
    "megatron": ".megatron.sh",
    "torchtitan": ".torchtitan.toml",
    "torchtitan-0.3": ".torchtitan.sh",
    "bridge": ".bridge.py",
}


def register(sub: argparse._SubParsersAction) -> None:
    from pipewright.cli.spec_args import add_command

    add_command(
        sub,
        "export-plan",
        run,
        help="write a plan as Megatron-LM's, Megatron-Bridge's or torchtitan's configuration",
        description="Read a `pipewright plan` file (or the RunSpec TOML `plan -o RUN.toml` writes) and "
        "print (or write with -o) the same model and layout for Megatron-LM (a shell array "
        "MEGATRON_ARGS), Megatron-Bridge 0.3.1 (a Python module: apply_plan(recipe config)), torchtitan "
        "0.2.2 (a TOML for --job.config_file) or torchtitan 0.3.0 (a shell array TORCHTITAN_ARGS: "
        "--module, --config and overrides).",
    )


def export(
    plan_path: str | Path,
    target: str,
    out: str | Path | None = None,
    *,
    write_csv: bool = True,
    overwrite: bool = False,
) -> tuple[str, list[Path]]:
    """The export of the plan file at ``plan_path`` for ``target`` and the files written: ``out`` when
    given, and for torchtitan a schedule CSV when PyTorch has no class for the plan's schedule (the
    plan's own CSV when it has one, else the schedule built by name, beside ``out`` or the plan;
    ``write_csv=False``: not written, the text names it). Files are checked before anything is written
    (:func:`pipewright.outputs.check_output`; an existing one only with ``overwrite``)."""
    from pipewright.plan.export_text import export_text
    from pipewright.plan.planfile import load

    plan = load(plan_path)
    check_output(out, "-o", overwrite=overwrite, inputs=[plan_path])
    written: list[Path] = []
    csv = None
    if target.startswith("torchtitan") and plan["schedule"] not in TORCH_SCHEDULES and write_csv:
        csv, made = _schedule_csv(plan, Path(plan_path), None if out is None else Path(out), overwrite)
        written += made
    text = export_text(plan, target, source=Path(plan_path).name, schedule_csv=csv)
    if out is not None:
        Path(out).write_text(text)
        written.append(Path(out))
    return text, written


def _schedule_csv(plan, plan_path: Path, out: Path | None, overwrite: bool) -> tuple[str, list[Path]]:
    """The path torchtitan is given for the plan's order, and the files written for it."""
    own = plan.schedule_csv(plan_path)
    if own is not None:
        return own, []
    from pipewright.features import library_schedules
    from pipewright.passes.pytorch_csv import to_csv
    from pipewright.schedules import build_schedule

    sched = build_schedule(
        plan["schedule"],
        int(plan["pp"]),
        int(plan["microbatches"]),
        int(plan.data.get("virtual", 1)),
        registry=library_schedules(),
    )
    path = (out or plan_path).with_suffix(".schedule.csv")
    text = to_csv(sched)
    if path.is_file() and path.read_text(errors="replace") == text:
        return str(path), []  # written before, the same
    check_output(path, "the schedule CSV", overwrite=overwrite, inputs=[plan_path])
    path.write_text(text)
    return str(path), [path]


def run(args: argparse.Namespace) -> int:
    from pipewright.cli.spec_args import required

    spec = args.spec
    plan, target, out = spec.parallelism.plan, spec.export.to, spec.output.out
    required("export-plan", PLAN=plan, **{"--to": target})
    text, written = export(_report(plan), target, out, overwrite=spec.output.overwrite)
    if out is None:
        print(text, end="")
    for path in written:
        print(f"wrote {path}")
    return 0


def _report(path: str) -> str:
    """The plan JSON of ``path``: itself, or the one a RunSpec TOML names (``parallelism.plan``)."""
    from pipewright.plan.run_toml import is_spec_path

    if not is_spec_path(path):
        return path
    from pipewright.runspec import load_toml

    plan = load_toml(path, "export-plan").parallelism.plan
    if plan is None:
        from pipewright.errors import ConfigError

        raise ConfigError(f"{path} names no plan (parallelism.plan); write it with pipewright plan -o {path}")
    return str(Path(path).parent / plan)
