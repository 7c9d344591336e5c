"""``pipewright schedule show|export``."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipewright.cli.guards import add_max_actions, check_schedule_command
from pipewright.cli.zb_flags import add_zb_refine_flags, ilp_line, refine_seconds
from pipewright.features import library_schedules
from pipewright.ir import peak_in_flight
from pipewright.outputs import add_overwrite_flag, check_output
from pipewright.passes import lower, validate
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule, info, schedule_names


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"schedule name: {', '.join(schedule_names(library_schedules()))}")
    parser.add_argument("--stages", "-p", type=int, required=True, help="pipeline ranks p")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches m")
    parser.add_argument("--virtual", "-v", type=int, default=None, help="model chunks per rank v")
    add_zb_refine_flags(parser)
    add_max_actions(parser)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("schedule", help="show or export a pipeline schedule")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    show = verbs.add_parser("show", help="print the schedule as a ranks × steps grid")
    add_shape_args(show)
    show.add_argument("--with-comms", action="store_true", help="show send/receive actions")
    show.set_defaults(func=_show)

    export = verbs.add_parser("export", help="write the schedule in PyTorch's CSV format")
    add_shape_args(export)
    export.add_argument("--format", choices=["torch-csv"], default="torch-csv")
    export.add_argument("--with-comms", action="store_true", help="include send/receive actions")
    export.add_argument("-o", "--output", required=True, help="file to write")
    add_overwrite_flag(export)
    export.set_defaults(func=_export)


def _build(args: argparse.Namespace):
    """The named schedule; with ``--zb-refine``, zb-auto's order refined under unit costs (limit p)."""
    seconds = refine_seconds(args, (args.name,))
    costs = None
    if seconds is not None:
        from pipewright.schedules import ScheduleCosts

        unit = (1.0,) * args.stages
        costs = ScheduleCosts(unit, unit, unit, 0.0, None, seconds)
    library = library_schedules()
    return build_schedule(
        args.name, args.stages, args.microbatches, args.virtual, costs=costs, registry=library
    )


def _show(args: argparse.Namespace) -> int:
    check_schedule_command(args, grid=True)
    sched = validate(_build(args))
    entry = info(args.name, library_schedules())
    if args.with_comms:
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
    check_schedule_command(args, grid=False)
    check_output(args.output, "-o", overwrite=args.overwrite)
    sched = validate(_build(args))
    Path(args.output).write_text(to_csv(sched, with_comms=args.with_comms))
    print(f"wrote {args.output}")
    return 0
