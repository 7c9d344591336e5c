"""``pipewright simulate``: predict an iteration of a schedule with unit costs or a model on a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipewright.cli.cost_flags import (
    KERNEL_NAMES,
    MOE_FIELDS,
    RECOMPUTE_FLAGS,
    RECOMPUTE_HELP,
    add_cost_options,
    add_microbatch_group,
    add_moe_options,
    add_recompute_method,
    add_tp_comm_overlap,
    cost_fields,
    framework_efficiency,
    recompute_fields,
    tp_comm_overlap,
)
from pipewright.cli.guards import add_max_actions, check_simulate
from pipewright.cli.zb_flags import add_zb_refine_flags, ilp_line, refine_seconds
from pipewright.errors import ConfigError
from pipewright.features import builtin_features, library_schedules
from pipewright.models.spec import MLP_KINDS
from pipewright.outputs import add_overwrite_flag
from pipewright.passes.grad_reduce import GRAD_REDUCE
from pipewright.plan.request import PlanOverrides, SimulateRequest
from pipewright.schedules import build_schedule, schedule_names

if TYPE_CHECKING:  # the set-up and the simulator import numpy: only when a command runs
    from pipewright.ir import Schedule
    from pipewright.plan.setup import SimSetup

_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len", "kv_heads")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "simulate",
        help="predict the timeline, iteration time, bubble and memory of a pipeline schedule",
        description="Either --schedule with --stages/--microbatches and --cost unit, or --model on a "
        "cluster (--gpu, --nodes, --gpus-per-node, --tp/--pp/--dp, batch sizes), or --profile FILE "
        "(measured costs from `pipewright profile`). --cores N: the ranks share N CPU cores.",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        help=f"schedule name ({', '.join(schedule_names(library_schedules()))}) or CSV file",
    )
    parser.add_argument("--stages", "-p", type=int, help="pipeline ranks p (unit costs)")
    parser.add_argument("--microbatches", "-m", type=int, help="microbatches per iteration m (unit costs)")
    parser.add_argument("--virtual", "-v", type=int, default=None, help="model chunks per rank v")
    add_microbatch_group(parser)
    parser.add_argument(
        "--cost",
        choices=["unit"],
        default=None,
        help="unit: F=1, B=2, I=W=1 per chunk-microbatch, free communication",
    )
    parser.add_argument(
        "--profile",
        help="measured costs: a `pipewright profile` file (with --schedule, --stages, --microbatches; "
        "--microbatch-size and --layers default to the profile's)",
    )
    parser.add_argument(
        "--cores",
        type=float,
        default=None,
        help="the ranks (× tp × dp processes) share this many CPU cores: processor sharing, with the "
        "profile's contention curve when it has one",
    )
    model = parser.add_argument_group("model on a cluster")
    model.add_argument("--model", help="preset (gpt3-175b, gpt-tiny, …) or family (gpt, bert)")
    for dim in _DIMS:
        model.add_argument(f"--{dim.replace('_', '-')}", type=int, default=None, dest=dim)
    model.add_argument(
        "--mlp",
        choices=MLP_KINDS,
        default=None,
        help="MLP kind (default: the family's; gpt gelu, llama swiglu)",
    )
    model.add_argument("--no-bias", action="store_true", help="linear layers and norms without biases")
    model.add_argument(
        "--gpu",
        help="accelerator kind: v100, a100-40gb, a100-80gb, h100-sxm, h100-pcie, h800, h200, b200, cpu",
    )
    model.add_argument("--nodes", type=int, default=1)
    model.add_argument("--gpus-per-node", type=int, default=8)
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel size t")
    model.add_argument("--pp", type=int, default=None, help="pipeline-parallel size p")
    model.add_argument("--dp", type=int, default=1, help="data-parallel size d")
    model.add_argument(
        "--cp", type=int, default=1, help="context-parallel size c (ring attention; mesh order tp-cp-dp-pp)"
    )
    model.add_argument(
        "--microbatch-size", type=int, default=None, help="sequences per microbatch (default 1)"
    )
    model.add_argument("--global-batch-size", type=int, default=None)
    model.add_argument("--recompute", choices=RECOMPUTE_FLAGS, default="none", help=RECOMPUTE_HELP)
    add_recompute_method(model)
    model.add_argument(
        "--attention",
        choices=["flash", "eager"],
        default=None,
        help="flash (fused attention; the default) or eager (the a·s² scores stored, Megatron-LM 2021); "
        "with --plan, the plan's (eager for plans that do not record it)",
    )
    model.add_argument(
        "--attention-kernel",
        choices=KERNEL_NAMES,
        default=None,
        help="the fused attention kernel priced (published speed per GPU; default the GPU's usual: "
        "fa2 on A100, cudnn on H100/H200/H800)",
    )
    add_moe_options(model)
    add_cost_options(model)
    shard = model.add_mutually_exclusive_group()
    shard.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="distributed optimizer / ZeRO-1: optimizer state sharded over dp × cp",
    )
    shard.add_argument(
        "--fsdp", action="store_true", help="FSDP / ZeRO-3: weights, gradients and optimizer state sharded"
    )
    add_tp_comm_overlap(model)
    model.add_argument(
        "--calibration", help="a measured calibration (`pipewright profile --calibration`) of --gpu"
    )
    model.add_argument(
        "--layout", help="stage layout, e.g. 'E|t*8|t*8|tL' (uneven; embedding- or output-only stages)"
    )
    model.add_argument(
        "--zb-memory-limit",
        type=float,
        default=None,
        help="zb-auto: at most this many microbatches in flight per rank (default 2p − 1)",
    )
    add_zb_refine_flags(model)
    model.add_argument(
        "--sequence-parallel", action="store_true", help="with --tp: sequence parallelism (Korthikanti)"
    )
    model.add_argument("--plan", help="a `pipewright plan` file: its layout, degrees and device order")
    model.add_argument("--dtype", help="compute dtype (default: bf16 where the GPU has it, else fp16)")
    model.add_argument(
        "--grad-reduce",
        choices=GRAD_REDUCE,
        default=None,
        help="with --dp > 1, the gradient all-reduce: 'after' the pipeline drains (Megatron-LM's default; "
        "the default with --model) or 'overlap'ped with the remaining backward (pipewright's executor; "
        "the default with --profile)",
    )
    model.add_argument(
        "--rank-order",
        default=None,
        help="rank order, innermost first (default tp-dp-pp, Megatron's; e.g. tp-pp-dp)",
    )
    model.add_argument("--topology", help="cluster topology JSON (default: built from --nodes/--gpu)")
    parser.add_argument("--iterations", type=int, default=1, help="iterations to simulate (steady state)")
    parser.add_argument(
        "--no-step-barrier",
        action="store_true",
        help="no global synchronization at the optimizer step (per-stage ordering only)",
    )
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")
    parser.add_argument("--png", help="write the timeline picture to this PNG file")
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace JSON to this file")
    parser.add_argument("--enforce-memory", action="store_true", help="fail when a rank does not fit")
    parser.add_argument(
        "--allow-no-fit",
        action="store_true",
        help="exit 0 even when a rank does not fit its device's memory (DOES NOT FIT; exit 1 without it)",
    )
    add_overwrite_flag(parser)
    builtin_features().add_options("simulate", parser)  # the features' flags
    add_max_actions(parser)
    parser.set_defaults(func=run)


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


def _unit_setup(args: argparse.Namespace) -> SimSetup:
    from pipewright.plan.setup import unit_setup

    setup = unit_setup(
        _load_schedule(
            args.schedule,
            args.stages,
            args.microbatches,
            args.virtual,
            getattr(args, "microbatch_group", None),
        )
    )
    seconds = refine_seconds(args, (args.schedule,))
    if seconds is None:
        return setup
    m, v = args.microbatches, args.virtual
    return unit_setup(_costed_schedule(args.schedule, args.stages, m, v, setup, refine=seconds))


def _profile_setup(args: argparse.Namespace, plan: PlanOverrides | None = None) -> SimSetup:
    """Measured costs: ProfiledCost and ProfiledComm from a ``pipewright profile`` file."""
    from pipewright.cost.profiled import load_profile
    from pipewright.plan.setup import core_sharing, profile_setup

    if args.grad_reduce == "after":
        raise ConfigError(
            "--profile predicts pipewright's executor, which overlaps the gradient reduction; "
            "drop --grad-reduce after"
        )
    path = Path(args.profile)
    rows, meta = load_profile(path)
    sizes = sorted({r.microbatch_size for r in rows})
    b = args.microbatch_size or (sizes[0] if sizes else 1)
    layers = args.layers or int(meta.get("layers", "0") or 0)
    if layers < 1:
        raise ConfigError(f"profile {path} does not name its layer count; give --layers")
    p = args.pp if args.pp is not None else args.stages
    sched = _load_schedule(
        args.schedule, p, args.microbatches, args.virtual, getattr(args, "microbatch_group", None)
    )
    tp, dp = int(meta.get("tp", "1")), args.dp
    shared = core_sharing(sched.num_ranks, args.cores, meta, processes_per_rank=tp * dp)
    label = f"profile {path.name} (b={b}, {layers} layers, t={tp}, d={dp})"
    layout = plan.layout if plan is not None else None  # a plan's layers per chunk (--plan)
    opts = {"tp": tp, "dp": dp, "layout": layout, "shared": shared, "label": label}
    setup = profile_setup(rows, meta, sched, b, layers, **opts)
    seconds = refine_seconds(args, (args.schedule,))
    costed = _costed_schedule(args.schedule, p, args.microbatches, args.virtual, setup, refine=seconds)
    if costed is None:
        return setup
    return profile_setup(rows, meta, costed, b, layers, **opts)


def _model_setup(args: argparse.Namespace, plan: PlanOverrides | None = None) -> SimSetup:
    """Model + cluster: resolve the preset, the accelerator and the topology, then the cost models."""
    from pipewright.mesh import DEFAULT_ORDER, Mesh
    from pipewright.models.presets import resolve_model
    from pipewright.plan.apply import plan_mesh
    from pipewright.plan.setup import cluster_topology, microbatches_per_pipeline, model_setup

    model = resolve_model(args.model, **{d: getattr(args, d) for d in (*_DIMS, *MOE_FIELDS)})
    if args.mlp or args.no_bias:
        model = replace(model, mlp=args.mlp or model.mlp, bias=False if args.no_bias else model.bias)
    if plan is not None:
        plan.plan.check_model(model)
    topo, gpu = cluster_topology(args.gpu, args.nodes, args.gpus_per_node, args.topology)
    t, d = args.tp, args.dp
    p = args.pp if args.pp is not None else (args.stages or 1)
    order = args.rank_order or (DEFAULT_ORDER if args.cp == 1 else "tp-cp-dp-pp")
    mesh = plan_mesh(
        plan and plan.devices, topo, Mesh(t, p, d, order, cp=args.cp, ep=args.ep)
    )  # a plan's placement
    b = args.microbatch_size or 1
    if args.global_batch_size is not None:
        m = microbatches_per_pipeline(args.global_batch_size, b, d)
    elif args.microbatches is not None:
        m = args.microbatches
    else:
        raise ConfigError("--model needs --global-batch-size (or --microbatches)")
    sched = _load_schedule(args.schedule, p, m, args.virtual, getattr(args, "microbatch_group", None))
    calibration = None
    if args.calibration:
        from pipewright.cost.calibration import load_calibration

        calibration = load_calibration(args.calibration, gpu.name)
    sharding = "zero1" if args.shard_optimizer else "fsdp" if args.fsdp else "none"

    def build(schedule: Schedule) -> SimSetup:
        return model_setup(
            model,
            topo,
            mesh,
            schedule,
            b,
            gpu=gpu,
            dtype=args.dtype,
            recompute=args.recompute,
            grad_reduce=args.grad_reduce or "after",
            sequence_parallel=getattr(args, "sequence_parallel", False),
            layout=plan.layout if plan is not None else args.layout,
            per_stage_recompute=plan.recompute if plan is not None else None,
            attention=_attention(args, plan),
            optimizer_sharding=sharding,
            tp_comm_overlap=tp_comm_overlap(args),
            calibration=calibration,
            attention_kernel=args.attention_kernel,
            moe_imbalance=args.moe_imbalance,
            efficiency=framework_efficiency(args, [gpu]),
            **cost_fields(args),
            **recompute_fields(args),
        )

    setup = build(sched)
    seconds = refine_seconds(args, (args.schedule,))
    costed = _costed_schedule(args.schedule, p, m, args.virtual, setup, args.zb_memory_limit, seconds)
    return setup if costed is None else build(costed)


def _attention(args: argparse.Namespace, plan: PlanOverrides | None) -> str:
    """--attention, else the plan's (plans made before the planner priced flash attention were
    priced eager), else flash."""
    if args.attention:
        return args.attention
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
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from pipewright.cost.memory_parts import rank_memory_parts
    from pipewright.plan.setup import core_sharing
    from pipewright.sim import metrics

    given = [
        flag
        for flag, value in (("--cost unit", args.cost), ("--model", args.model), ("--profile", args.profile))
        if value
    ]
    if len(given) > 1:
        raise ConfigError(f"give one of --cost unit, --model, --profile (got {' and '.join(given)})")
    plan = None
    if getattr(args, "plan", None):
        from pipewright.plan.apply import applied, simulate_overrides

        plan = simulate_overrides(args)
        args = applied(args, plan)
    if args.schedule is None:
        raise ConfigError("pipewright simulate needs --schedule NAME (or --plan FILE)")
    check_simulate(args)  # ranges, ignored flags, CSV vs flags, size (cli/guards.py)
    if args.profile is not None:
        setup = _profile_setup(args, plan)
    else:
        setup = _unit_setup(args) if args.model is None else _model_setup(args, plan)
        if args.cores is not None:
            ppr = args.tp * args.dp
            setup = replace(setup, shared=core_sharing(setup.schedule.num_ranks, args.cores, {}, ppr))
    request = SimulateRequest.from_options(vars(args), plan)
    for feature in builtin_features():  # each feature may transform the setup or run the command
        hook = feature.simulate_hook()
        if hook is not None:
            outcome = hook(request, setup)
            if isinstance(outcome, int):
                return outcome
            setup = outcome
    shared = setup.shared
    result = setup.simulate(iterations=args.iterations, step_barrier=not args.no_step_barrier, validate=True)
    report = metrics(
        result,
        num_devices_per_rank=setup.devices_per_rank,
        peak_flops=setup.peak_flops,
        memory_limit=setup.memory_limit,
        enforce=args.enforce_memory,
    )
    parts = rank_memory_parts(setup.cost, result.source, list(result.peak_memory))
    if parts is not None:
        for row, part in zip(report["per_rank"], parts, strict=True):
            row["memory_parts"] = part
    label = setup.label + ("" if shared is None else f", sharing {args.cores:g} cores")
    if args.png or args.trace:
        from pipewright.viz import draw_timeline, write_trace

        if args.png:
            title = f"{result.source.name}, {label}"
            xlabel = "time (unit costs)" if setup.unit else "time (s)"
            draw_timeline(result.timeline, args.png, titles=[title], xlabel=xlabel)
        if args.trace:
            write_trace(result.timeline, args.trace)
    ilp = setup.schedule.meta.get("ilp")  # zb-auto's refinement (--zb-refine), when it ran
    if ilp is not None:
        report["zb_ilp"] = ilp
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_summary(report, label, unit=setup.unit))
        if ilp is not None:
            print(ilp_line(ilp))
        for path in (args.png, args.trace):
            if path:
                print(f"wrote {path}")
    return _fit_exit(report["memory"], setup.unit, args.allow_no_fit)


def _fit_exit(mem: dict, unit: bool, allowed: bool) -> int:
    """1 with a one-line error when a rank exceeds its device's memory (``DOES NOT FIT``), unless
    ``--allow-no-fit``: a layout that cannot run is not a success."""
    if mem["limit_bytes"] is None or mem["fits"] or allowed:
        return 0
    limit = f"{mem['limit_bytes']:g}" if unit else f"{mem['limit_bytes'] / 2**30:.2f} GiB"
    print(
        f"pipewright: error: ranks {mem['over_limit']} do not fit {limit} per device; raise --tp or --pp, "
        "use --recompute full or a smaller --microbatch-size (or give --allow-no-fit to exit 0)",
        file=sys.stderr,
    )
    return 1


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
