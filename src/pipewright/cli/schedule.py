"""``pipewright schedule show|export``: each verb's flags the RunSpec's (``schedule show --config
RUN.toml`` shows a run's schedule): the schedule's name, ``--stages``/``--pp``, ``--microbatches``,
``--virtual``, the refinement and size limit, ``[schedule_view]`` and, for ``export``, ``-o``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pipewright.cli.guards import check_schedule_command
from pipewright.cli.spec_args import add_command, required
from pipewright.cli.zb_flags import ilp_line, refine_seconds
from pipewright.features import library_schedules
from pipewright.ir import peak_in_flight
from pipewright.outputs import check_output
from pipewright.passes import lower, validate
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule, info, schedule_names

if TYPE_CHECKING:
    from pipewright.runspec import RunSpec


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("schedule", help="show or export a pipeline schedule")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    show = add_command(verbs, "schedule show", _show, help="print the schedule as a ranks × steps grid")
    export = add_command(verbs, "schedule export", _export, help="write the schedule in PyTorch's CSV format")
    names = ", ".join(schedule_names(library_schedules()))
    for verb in (show, export):  # the positional's help: the registered names (the library's and features')
        name = next(a for a in verb._actions if a.dest == "schedule.name")
        name.help = name.help.replace("schedule name", f"schedule name: {names}", 1)


def _shape(args: argparse.Namespace) -> RunSpec:
    """The verb's run spec: its required values (flags, or the ``--config`` file), then the size
    checks."""
    spec = args.spec
    sizes = {"--stages": spec.parallelism.pp, "--microbatches": spec.batch.microbatches}
    required(f"schedule {args.verb}", NAME=spec.schedule.name, **sizes)
    check_schedule_command(spec, grid=args.verb == "show")
    return spec


def _build(spec: RunSpec):
    """The named schedule; with ``--zb-refine``, zb-auto's order refined under unit costs (limit p)."""
    name, stages = spec.schedule.name, spec.parallelism.pp
    seconds = refine_seconds(spec.schedule, (name,))
    costs = None
    if seconds is not None:
        from pipewright.schedules import ScheduleCosts

        unit = (1.0,) * stages
        costs = ScheduleCosts(unit, unit, unit, 0.0, None, seconds)
    library = library_schedules()
    return build_schedule(
        name, stages, spec.batch.microbatches, spec.parallelism.virtual, costs=costs, registry=library
    )


def _show(args: argparse.Namespace) -> int:
    spec = _shape(args)
    sched = validate(_build(spec))
    entry = info(spec.schedule.name, library_schedules())
    if spec.schedule_view.with_comms:
        sched = validate(lower(sched))
    print(
        f"{sched.name}: p={sched.num_ranks} ranks, {sched.num_stages} stages, "
        f"m={sched.num_microbatches} microbatches"
    )
    print(f"bubble {entry.bubble}; activation memory {entry.memory_formula}  [{entry.source}]")
    print(sched.grid())
    if "ilp" in sched.meta:
        print(ilp_line(sched.meta["ilp"]))
    peaks = ", ".join(f"{float(x):g}" for x in peak_in_flight(sched))
    print(f"peak microbatches in flight per rank: {peaks}")
    return 0


def _export(args: argparse.Namespace) -> int:
    spec = _shape(args)
    out = spec.output
    required("schedule export", **{"-o/--output": out.out})
    check_output(out.out, "-o", overwrite=out.overwrite)
    sched = validate(_build(spec))
    Path(out.out).write_text(to_csv(sched, with_comms=spec.schedule_view.with_comms))
    print(f"wrote {out.out}")
    return 0
