"""``pipewright simulate``: predict an iteration of a schedule with unit costs or a model on a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipewright.cli.guards import check_simulate
from pipewright.cli.spec_args import add_command
from pipewright.cli.zb_flags import ilp_line, refine_seconds
from pipewright.errors import ConfigError
from pipewright.features import builtin_features, library_schedules
from pipewright.plan.request import PlanOverrides, SimulateRequest
from pipewright.schedules import build_schedule

if TYPE_CHECKING:  # the set-up and the simulator import numpy: only when a command runs
    from pipewright.cost.calibration import Calibration
    from pipewright.hardware import Accelerator
    from pipewright.ir import Schedule
    from pipewright.mesh import Mesh
    from pipewright.models.spec import ModelSpec
    from pipewright.plan.setup import SimSetup
    from pipewright.runspec import RunSpec
    from pipewright.topology import Topology


def register(sub: argparse._SubParsersAction) -> None:
    add_command(
        sub,
        "simulate",
        run,
        help="predict the timeline, iteration time, bubble and memory of a pipeline schedule",
        description="Either --schedule with --stages/--microbatches and --cost unit, or --model on a "
        "cluster (--gpu, --nodes, --gpus-per-node, --tp/--pp/--dp, batch sizes), or --profile FILE "
        "(measured costs from `pipewright profile`), or --config RUN.toml (a RunSpec: "
        "docs/run-spec.md; the flags override it). --cores N: the ranks share N CPU cores.",
    )


def _load_schedule(
    name: str, stages: int | None, microbatches: int | None, virtual: int | None, group: int | None = None
) -> Schedule:
    """A schedule file (validated here: user input) or a library schedule, which :func:`run` validates
    lowered, in one pass with the simulation (``simulate(validate=True)``). ``group``: the microbatch
    group N of a schedule that registers ``build_grouped`` in its ``extra``."""
    from pipewright.codec import load_csv
    from pipewright.passes import validate

    library = library_schedules()
    if name not in library and (name.endswith(".csv") or Path(name).is_file()):
        if group is not None:
            raise ConfigError("--microbatch-group applies to a library schedule, not a schedule file")
        return validate(load_csv(name))
    if stages is None or microbatches is None:
        raise ConfigError(f"--schedule {name} needs --stages and --microbatches (or --pp and batch sizes)")
    if group is None:
        return build_schedule(name, stages, microbatches, virtual, registry=library)
    from pipewright.schedules.registry import info

    grouped = info(name, library).extra.get("build_grouped")
    if grouped is None:
        raise ConfigError(f"--microbatch-group applies to schedules that group microbatches; {name} does not")
    v = info(name, library).default_chunks if virtual is None else virtual
    return grouped(stages, microbatches, v, group)


def _unit_setup(spec: RunSpec) -> SimSetup:
    from pipewright.plan.setup import unit_setup

    name, par, m = spec.schedule.name, spec.parallelism, spec.batch.microbatches
    setup = unit_setup(_load_schedule(name, par.pp, m, par.virtual, spec.schedule.microbatch_group))
    seconds = refine_seconds(spec.schedule, (name,))
    if seconds is None:
        return setup
    return unit_setup(_costed_schedule(name, par.pp, m, par.virtual, setup, refine=seconds))


def _profile_setup(spec: RunSpec, plan: PlanOverrides | None = None) -> SimSetup:
    """Measured costs: ProfiledCost and ProfiledComm from a ``pipewright profile`` file."""
    from pipewright.cost.profiled import load_profile
    from pipewright.plan.setup import core_sharing, profile_setup

    if spec.framework.grad_reduce == "after":
        raise ConfigError(
            "--profile predicts pipewright's executor, which overlaps the gradient reduction; "
            "drop --grad-reduce after"
        )
    path = Path(spec.cluster.profile)
    rows, meta = load_profile(path)
    sizes = sorted({r.microbatch_size for r in rows})
    b = spec.batch.microbatch_size or (sizes[0] if sizes else 1)
    layers = spec.model.layers or int(meta.get("layers", "0") or 0)
    if layers < 1:
        raise ConfigError(f"profile {path} does not name its layer count; give --layers")
    name, par, m = spec.schedule.name, spec.parallelism, spec.batch.microbatches
    sched = _load_schedule(name, par.pp, m, par.virtual, spec.schedule.microbatch_group)
    tp, dp = int(meta.get("tp", "1")), par.dp
    shared = core_sharing(sched.num_ranks, spec.cluster.cores, meta, processes_per_rank=tp * dp)
    label = f"profile {path.name} (b={b}, {layers} layers, t={tp}, d={dp})"
    layout = plan.layout if plan is not None else None  # a plan's layers per chunk (--plan)
    opts = {"tp": tp, "dp": dp, "layout": layout, "shared": shared, "label": label}
    setup = profile_setup(rows, meta, sched, b, layers, **opts)
    seconds = refine_seconds(spec.schedule, (name,))
    costed = _costed_schedule(name, par.pp, m, par.virtual, setup, refine=seconds)
    if costed is None:
        return setup
    return profile_setup(rows, meta, costed, b, layers, **opts)


def _model_setup(spec: RunSpec, plan: PlanOverrides | None = None) -> SimSetup:
    """Model + cluster: resolve the preset, the accelerator and the topology, then the cost models."""
    from pipewright.mesh import DEFAULT_ORDER, Mesh
    from pipewright.plan.apply import plan_mesh
    from pipewright.plan.setup import cluster_topology, microbatches_per_pipeline
    from pipewright.runspec.model_spec import model_spec

    model = model_spec(spec.model)
    if plan is not None:
        plan.plan.check_model(model)
    c, par, batch = spec.cluster, spec.parallelism, spec.batch
    topo, gpu = cluster_topology(c.gpu, c.nodes, c.gpus_per_node, c.topology)
    p = par.pp or 1
    order = par.rank_order or (DEFAULT_ORDER if par.cp == 1 else "tp-cp-dp-pp")
    mesh = Mesh(par.tp, p, par.dp, order, cp=par.cp, ep=par.ep)
    mesh = plan_mesh(plan and plan.devices, topo, mesh)  # a plan's placement
    b = batch.microbatch_size or 1
    if batch.global_batch_size is not None:
        m = microbatches_per_pipeline(batch.global_batch_size, b, par.dp)
    elif batch.microbatches is not None:
        m = batch.microbatches
    else:
        raise ConfigError("--model needs --global-batch-size (or --microbatches)")
    name = spec.schedule.name
    sched = _load_schedule(name, p, m, par.virtual, spec.schedule.microbatch_group)
    calibration = None
    if c.calibration:
        from pipewright.cost.calibration import load_calibration

        calibration = load_calibration(c.calibration, gpu.name)

    def build(schedule: Schedule) -> SimSetup:
        return _priced(spec, plan, model, topo, mesh, schedule, b, gpu, calibration)

    setup = build(sched)
    seconds = refine_seconds(spec.schedule, (name,))
    costed = _costed_schedule(name, p, m, par.virtual, setup, spec.schedule.zb_memory_limit, seconds)
    return setup if costed is None else build(costed)


def _priced(
    spec: RunSpec,
    plan: PlanOverrides | None,
    model: ModelSpec,
    topo: Topology,
    mesh: Mesh,
    schedule: Schedule,
    b: int,
    gpu: Accelerator,
    calibration: Calibration | None,
) -> SimSetup:
    """The analytical costs of ``schedule`` (:func:`pipewright.plan.setup.model_setup`) with the
    spec's precision, memory and framework inputs, and a plan's layers per chunk and recomputation."""
    from pipewright.plan.setup import model_setup
    from pipewright.plan.spec_inputs import (
        cost_fields,
        framework_efficiency,
        optimizer_sharding,
        recompute_fields,
        tp_comm_overlap,
    )

    return model_setup(
        model,
        topo,
        mesh,
        schedule,
        b,
        gpu=gpu,
        dtype=spec.precision.dtype,
        recompute=spec.memory.recompute,
        grad_reduce=spec.framework.grad_reduce or "after",
        sequence_parallel=spec.parallelism.sequence_parallel,
        layout=plan.layout if plan is not None else spec.parallelism.layout,
        per_stage_recompute=plan.recompute if plan is not None else None,
        attention=_attention(spec, plan),
        optimizer_sharding=optimizer_sharding(spec),
        tp_comm_overlap=tp_comm_overlap(spec),
        calibration=calibration,
        attention_kernel=spec.framework.attention_kernel,
        moe_imbalance=spec.model.moe.imbalance,
        efficiency=framework_efficiency(spec, [gpu]),
        **cost_fields(spec),
        **recompute_fields(spec),
    )


def _attention(spec: RunSpec, plan: PlanOverrides | None) -> str:
    """--attention, else the plan's (plans made before the planner priced flash attention were
    priced eager), else flash."""
    if spec.framework.attention:
        return spec.framework.attention
    return getattr(plan.plan, "attention", "eager") if plan is not None else "flash"


def _costed_schedule(
    name: str,
    p: int,
    m: int,
    virtual: int | None,
    setup: SimSetup,
    memory_limit: float | None = None,
    refine: float | None = None,
) -> Schedule | None:
    """For a generator that plans with costs (``zb-auto``): the schedule built from this setup's stage
    times and boundary-message time instead of unit costs (at most ``memory_limit`` microbatches in
    flight per rank; ``refine``: seconds for zb-auto's ILP refinement); None for other schedules."""
    library = library_schedules()
    if name not in library or library[name].build_costed is None:
        return None
    from pipewright.schedules.schedule_costs import schedule_costs

    probe = setup.schedule
    costs = schedule_costs(
        setup.cost, probe.num_ranks, probe.chunks_per_rank, comm=setup.comm, memory_limit=memory_limit
    )
    costs = replace(costs, refine_time_limit=refine)
    return build_schedule(name, p, m, virtual, costs=costs, registry=library)


def run(args: argparse.Namespace) -> int:
    from pipewright.sim.compiled import gc_paused

    with gc_paused(freeze=True):  # the schedule's hundreds of thousands of actions hold no cycles
        return _run(args.spec)


def _setup(spec: RunSpec) -> tuple[SimSetup, PlanOverrides | None, RunSpec]:
    """The costs ``spec`` prices (unit, measured or a model's), and the spec with its plan file
    applied (``parallelism.plan``) and that plan's data."""
    from pipewright.plan.setup import core_sharing
    from pipewright.plan.spec_inputs import with_framework_defaults

    spec = with_framework_defaults(spec)  # before a plan's: the framework given wins over the plan's
    c = spec.cluster
    given = [
        flag
        for flag, value in (("--cost unit", c.cost), ("--model", spec.model.model), ("--profile", c.profile))
        if value
    ]
    if len(given) > 1:
        raise ConfigError(f"give one of --cost unit, --model, --profile (got {' and '.join(given)})")
    plan = None
    if spec.parallelism.plan:
        from pipewright.plan.apply import simulate_plan

        spec, plan = simulate_plan(spec)
    if spec.schedule.name is None:
        raise ConfigError("pipewright simulate needs --schedule NAME (or --plan FILE)")
    check_simulate(spec)  # ranges, ignored flags, CSV vs flags, size (cli/guards.py)
    c = spec.cluster
    if c.profile is not None:
        return _profile_setup(spec, plan), plan, spec
    setup = _unit_setup(spec) if spec.model.model is None else _model_setup(spec, plan)
    if c.cores is not None:
        ppr = spec.parallelism.tp * spec.parallelism.dp
        setup = replace(setup, shared=core_sharing(setup.schedule.num_ranks, c.cores, {}, ppr))
    return setup, plan, spec


def priced_cost(spec: RunSpec):
    """The cost model ``simulate`` prices ``spec`` with (``pipewright calibrate`` reads a run's shape
    from it, :func:`pipewright.cost.shape_scales.shape_of`)."""
    return _setup(spec)[0].cost


def simulated(spec: RunSpec) -> dict:
    """The report ``pipewright simulate --json`` prints for ``spec`` (``pipewright calibrate``'s
    prediction of a run); a one-line ConfigError where the simulation fails or a rank does not fit
    (the command's exit status 1)."""
    from pipewright.sim.compiled import gc_paused

    with gc_paused(freeze=True):
        outcome = _simulation(spec)
    if isinstance(outcome, int):
        raise ConfigError("a feature's simulate hook ran its own command; it predicts no iteration")
    report, setup = outcome[0], outcome[1]
    mem = report["memory"]
    if not (mem["limit_bytes"] is None or mem["fits"] or spec.simulation.allow_no_fit):
        raise ConfigError(_no_fit(mem, setup.unit))
    return report


def _simulation(spec: RunSpec) -> int | tuple[dict, SimSetup, RunSpec, str]:
    """The simulation of ``spec``: its report, set-up, spec (a plan applied) and label; or the exit
    status of a feature's hook that ran the command itself (``--fill kfac``)."""
    from pipewright.cost.memory_parts import rank_memory_parts
    from pipewright.sim import metrics

    setup, plan, spec = _setup(spec)
    request = SimulateRequest(spec, plan)
    for feature in builtin_features():  # each feature may transform the setup or run the command
        hook = feature.simulate_hook()
        if hook is not None:
            outcome = hook(request, setup)
            if isinstance(outcome, int):
                return outcome
            setup = outcome
    sim, out = spec.simulation, spec.output
    result = setup.simulate(iterations=sim.iterations, step_barrier=not sim.no_step_barrier, validate=True)
    report = metrics(
        result,
        num_devices_per_rank=setup.devices_per_rank,
        peak_flops=setup.peak_flops,
        memory_limit=setup.memory_limit,
        enforce=sim.enforce_memory,
    )
    parts = rank_memory_parts(setup.cost, result.source, list(result.peak_memory))
    if parts is not None:
        for row, part in zip(report["per_rank"], parts, strict=True):
            row["memory_parts"] = part
    label = setup.label + ("" if setup.shared is None else f", sharing {spec.cluster.cores:g} cores")
    _pictures(result, setup, label, out.png, out.trace)
    ilp = setup.schedule.meta.get("ilp")  # zb-auto's refinement (--zb-refine), when it ran
    if ilp is not None:
        report["zb_ilp"] = ilp
    return report, setup, spec, label


def _run(spec: RunSpec) -> int:
    outcome = _simulation(spec)
    if isinstance(outcome, int):
        return outcome
    report, setup, spec, label = outcome
    out, ilp = spec.output, report.get("zb_ilp")
    if out.json:
        print(json.dumps(report, indent=2))
    else:
        print(_summary(report, label, unit=setup.unit))
        if ilp is not None:
            print(ilp_line(ilp))
        for path in (out.png, out.trace):
            if path:
                print(f"wrote {path}")
    return _fit_exit(report["memory"], setup.unit, spec.simulation.allow_no_fit)


def _pictures(result, setup: SimSetup, label: str, png: str | None, trace: str | None) -> None:
    """``--png`` (the timeline drawn) and ``--trace`` (a Chrome/Perfetto trace), where given."""
    if not (png or trace):
        return
    from pipewright.viz import draw_timeline, write_trace

    if png:
        title = f"{result.source.name}, {label}"
        xlabel = "time (unit costs)" if setup.unit else "time (s)"
        draw_timeline(result.timeline, png, titles=[title], xlabel=xlabel)
    if trace:
        write_trace(result.timeline, trace)


def _fit_exit(mem: dict, unit: bool, allowed: bool) -> int:
    """1 with a one-line error when a rank exceeds its device's memory (``DOES NOT FIT``), unless
    ``--allow-no-fit``: a layout that cannot run is not a success."""
    if mem["limit_bytes"] is None or mem["fits"] or allowed:
        return 0
    print(f"pipewright: error: {_no_fit(mem, unit)}", file=sys.stderr)
    return 1


def _no_fit(mem: dict, unit: bool) -> str:
    limit = f"{mem['limit_bytes']:g}" if unit else f"{mem['limit_bytes'] / 2**30:.2f} GiB"
    return (
        f"ranks {mem['over_limit']} do not fit {limit} per device; raise --tp or --pp, "
        "use --recompute full or a smaller --microbatch-size (or give --allow-no-fit to exit 0)"
    )


def _summary(report: dict, label: str, unit: bool) -> str:
    def size(x: float) -> str:
        return f"{x:g}" if unit else f"{x / 2**30:.2f} GiB"

    def t(x: float) -> str:
        return f"{x:g}" if unit else f"{x:.4f} s"

    mfu = "n/a" if report["mfu"] is None else f"{100 * report['mfu']:.1f}%"
    lines = [
        f"{report['schedule']}, {label}, {report['iterations']} iteration(s)"
        + ("" if report["step_barrier"] else ", no step barrier"),
        f"iteration time      {t(report['iteration_time_s'])}",
        f"bubble fraction     {report['bubble_fraction']:.4f}",
        f"TFLOP/s per device  {report['tflops_per_device']:.4g}"
        + ("  (unit costs: busy fraction)" if unit else "")
        if report["tflops_per_device"] or unit
        else "TFLOP/s per device  n/a (the costs carry no FLOPs)",
        f"MFU                 {mfu}",
    ]
    mem = report["memory"]
    if mem["limit_bytes"] is not None and not mem["fits"]:
        lines.append(f"DOES NOT FIT: ranks {mem['over_limit']} exceed {size(mem['limit_bytes'])} per device")
    lines.append(f"{'rank':>4}  {'busy':>10}  {'bubble':>10}  {'bubble%':>7}  {'peak memory':>12}")
    for r in report["per_rank"]:
        lines.append(
            f"{r['rank']:>4}  {t(r['busy_s']):>10}  {t(r['bubble_s']):>10}  "
            f"{100 * r['bubble_fraction']:>6.1f}%  {size(r['peak_memory_bytes']):>12}"
        )
    if not unit and report["per_rank"] and "memory_parts" in report["per_rank"][0]:
        from pipewright.cost.memory_parts import memory_table

        lines.append(memory_table([r["memory_parts"] for r in report["per_rank"]]))
        lines.append(
            "peak memory (the fit check) = total - comm bufs - reserve: the buffers and the allocator's "
            "reserve are estimates shown beside it"
        )
    return "\n".join(lines)
