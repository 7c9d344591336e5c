"""``pipewright plan``: the fastest layout for a model on a cluster (docs/planner.md)."""

from __future__ import annotations

import argparse
import json

from pipewright.cli.cost_flags import (
    MOE_FIELDS,
    cost_fields,
    framework_efficiency,
    recompute_fields,
    tp_comm_overlap,
)
from pipewright.cli.guards import PLAN_MAX_DEVICES, check_devices
from pipewright.cli.progress import Bar
from pipewright.cli.spec_args import add_command, required
from pipewright.cli.zb_flags import refine_seconds
from pipewright.errors import ConfigError
from pipewright.outputs import check_output, check_outputs

_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")


def register(sub: argparse._SubParsersAction) -> None:
    add_command(
        sub,
        "plan",
        run,
        help="search tp/pp/dp, partition, device mapping, recomputation and schedule for a model",
        description="Plan a model on a cluster: --model with --topology FILE or --nodes/--gpus-per-node/"
        "--gpu, and --global-batch-size. Writes the plan (-o): a plan JSON, or with -o RUN.toml a RunSpec "
        "(docs/run-spec.md) and its search report RUN.plan.json, which `simulate`, `train` and `check` "
        "read with --plan or --config; prints the plan, the runner-ups and the baselines.",
    )


def _topology(args: argparse.Namespace):
    from pipewright.hardware import accelerator
    from pipewright.topology import Topology, cluster, single_host

    if args.topology:
        return Topology.load(args.topology)
    if not args.gpu:
        raise ConfigError("pipewright plan needs --topology FILE or --gpu KIND with --nodes/--gpus-per-node")
    gpu = accelerator(args.gpu)
    if gpu.name == "cpu":
        return single_host(args.nodes * args.gpus_per_node)
    return cluster(args.nodes, args.gpus_per_node, gpu.name, intra="nvlink" if gpu.nvlink else "pcie4")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} takes comma-separated positive integers (got {text!r})")
    return values


def check_values(args: argparse.Namespace) -> None:
    """One-line errors for numbers out of range, before any work (and an -o that cannot be written)."""
    import math

    for flag in (
        "global_batch_size",
        "nodes",
        "gpus_per_node",
        "max_tp",
        "max_cp",
        "max_ep",
        "finalists",
        "max_actions",
    ):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    for flag in ("tp", "pp", "dp", "cp", "ep", "kv_heads", "microbatch_group", *_DIMS):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    for flag in ("memory_limit", "cores"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a positive number (got {value})")
    check_plan_outputs(args)
    check_devices(args, PLAN_MAX_DEVICES, "plan")


def check_plan_outputs(args: argparse.Namespace) -> None:
    """``-o`` and the files written beside it (the schedule CSV, ``--export``'s file), before the search."""
    from pipewright.cli.export_plan import SUFFIX
    from pipewright.plan.run_toml import report_path

    if args.out is None:
        return
    inputs = [args.profile, args.topology, args.calibration]
    out = check_output(args.out, "-o", overwrite=args.overwrite, inputs=inputs)  # a file name, then:
    paths = [(out.with_suffix(".schedule.csv"), "-o's schedule CSV")]
    if report_path(out) != out:
        paths.append((report_path(out), "-o's search report"))
    if args.export:
        paths.append((out.with_suffix("").with_suffix(SUFFIX[args.export]), "-o's --export file"))
    check_outputs(paths, overwrite=args.overwrite, inputs=inputs)


def check_fixed_degrees(args: argparse.Namespace, devices: int) -> None:
    """The fixed --tp/--pp/--dp/--cp divide the device count (each and together) and --dp the global
    batch; one line naming the flag and values that work, before any layout is priced."""
    fixed = {d: getattr(args, d) for d in ("tp", "pp", "dp", "cp") if getattr(args, d, None)}
    for dim, value in fixed.items():
        if devices % value:
            works = ", ".join(str(k) for k in range(1, devices + 1) if devices % k == 0 and k <= 64)
            raise ConfigError(
                f"--{dim} {value} does not divide the {devices} devices; use --{dim} one of {works}"
            )
    product = 1
    for value in fixed.values():
        product *= value
    if len(fixed) > 1 and devices % product:
        given = " × ".join(f"--{d} {v}" for d, v in fixed.items())
        raise ConfigError(f"{given} = {product} does not divide the {devices} devices; fix fewer or smaller")
    dp = fixed.get("dp")
    if dp and args.global_batch_size % dp:
        up = -(-args.global_batch_size // dp) * dp
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of --dp {dp}; "
            f"use --global-batch-size {up} (or a --dp dividing it)"
        )


def run(args: argparse.Namespace) -> int:
    from pipewright.models.presets import resolve_model
    from pipewright.plan.options import check_recompute, cp_choices, searchable_sharding
    from pipewright.plan.report import make_plan, plan_json, summary
    from pipewright.plan.search import Problem
    from pipewright.schedules import schedule_names

    required("plan", **{"--global-batch-size": args.global_batch_size})  # from the flags or --config
    check_values(args)
    profile = None
    if args.profile is not None:
        if args.model is not None:
            raise ConfigError("give --model or --profile, not both (the profile names its model)")
        from pipewright.cost.profiled import load_profile
        from pipewright.plan.profiled import ProfileInput

        rows, meta = load_profile(args.profile)
        profile = ProfileInput(rows, meta, layers=args.layers)
        spec = profile.spec()
        args.gpu = args.gpu or meta.get("device", "cpu")
        args.dtype = args.dtype or meta.get("dtype", "fp32")
        args.recompute = "none"
        sizes = _ints(args.microbatch_sizes, "--microbatch-sizes")
        chosen = [b for b in profile.microbatch_sizes if b in sizes]
        if not chosen:
            raise ConfigError(
                f"the profile measured microbatch sizes {', '.join(map(str, profile.microbatch_sizes))}; "
                "give one of them in --microbatch-sizes"
            )
        args.microbatch_sizes = ",".join(map(str, chosen))
    elif args.model is None:
        raise ConfigError("pipewright plan needs --model NAME (or --profile FILE)")
    else:
        dims = {d: getattr(args, d) for d in (*_DIMS, *MOE_FIELDS)}
        spec = resolve_model(args.model, kv_heads=args.kv_heads, **dims)
        if args.mlp or args.no_bias:
            from dataclasses import replace

            spec = replace(spec, mlp=args.mlp or spec.mlp, bias=False if args.no_bias else spec.bias)
    if args.ep is not None:
        from pipewright.cost.moe_cost import check_expert_parallel

        if not spec.is_moe:
            raise ConfigError("--ep needs a mixture-of-experts model (--moe-experts or a MoE preset)")
        check_expert_parallel(spec, args.ep, args.ep if args.dp is None else args.dp)
    if args.moe_imbalance != 1.0 and not spec.is_moe:
        raise ConfigError("--moe-imbalance needs a mixture-of-experts model (--moe-experts or a MoE preset)")
    topo = _topology(args)
    check_fixed_degrees(args, len(topo.devices))
    kinds = [topo.accelerator(d) for d in {topo.nodes[x].accelerator: x for x in topo.devices}.values()]
    if args.calibration is not None:
        from pipewright.cost.calibration import load_calibration

        load_calibration(args.calibration, kinds[0].name)  # one line if measured on another GPU
    dtype = args.dtype or next(
        (x for x in ("bf16", "fp16", "fp32") if all(x in g.peak_flops for g in kinds)), "fp32"
    )
    for name in args.schedules.split(","):
        if name not in schedule_names():
            raise ConfigError(
                f"unknown schedule {name!r} in --schedules; choose from {', '.join(schedule_names())}"
            )
    if args.microbatch_group is not None:
        from pipewright.plan.grouping import grouped

        if not any(grouped(name) for name in args.schedules.split(",")):
            raise ConfigError(
                "--microbatch-group applies to schedules that group microbatches (interleaved-1f1b); "
                "add one to --schedules"
            )
    recompute = tuple(x for x in args.recompute.split(",") if x)
    check_recompute(recompute, spec, args.attention)
    from pipewright.cost.partial_recompute import check_partial

    check_partial(args.recompute_method, args.recompute_num_layers, args.recompute)
    prob = Problem(
        spec,
        topo,
        args.global_batch_size,
        dtype=dtype,
        memory_limit=None if args.memory_limit is None else args.memory_limit * 1e9,
        schedules=tuple(args.schedules.split(",")),
        recompute=recompute,
        microbatch_sizes=_ints(args.microbatch_sizes, "--microbatch-sizes"),
        max_tp=args.max_tp,
        finalists=args.finalists,
        fixed=(args.tp, args.pp, args.dp),
        cores=args.cores,
        profile=profile,
        max_actions=args.max_actions,
        attention=args.attention,
        cp_choices=cp_choices(len(topo.devices), spec.seq_len, args.cp, args.max_cp),
        sharding=searchable_sharding(tuple(x for x in args.optimizer_sharding.split(",") if x)),
        tp_comm_overlap=tp_comm_overlap(args),
        calibration=args.calibration,
        attention_kernel=args.attention_kernel,
        moe_imbalance=args.moe_imbalance,
        cost_fields=tuple(sorted(cost_fields(args).items())),
        efficiency=framework_efficiency(args, kinds),
        framework=args.framework,
        ep=args.ep,
        max_ep=args.max_ep,
        microbatch_group=args.microbatch_group,
        zb_refine_seconds=refine_seconds(args, tuple(args.schedules.split(","))),
        recompute_partial=tuple(sorted(recompute_fields(args).items())),
    )
    result = make_plan(prob, baselines=not args.no_baselines, progress=Bar(not args.no_progress))
    csv = None
    if args.out and result.best.schedule is not None:
        from pathlib import Path

        from pipewright.passes.pytorch_csv import to_csv

        csv = Path(args.out).with_suffix(".schedule.csv")
        csv.write_text(to_csv(result.best.schedule))
    data = plan_json(prob, result, schedule_csv=None if csv is None else csv.name)
    if "full" in (data.get("recompute_per_stage") or [data.get("recompute")]):
        from pipewright.plan.simulated import partial_fields

        # recorded for simulate --plan and the exports, as the finalists were simulated
        data |= partial_fields(prob, result.best.chunk_layers)
    if args.out:
        from pipewright.plan.planfile import Plan, save
        from pipewright.plan.run_toml import is_spec_path, report_path, write_spec

        save(data, report_path(args.out))
        if is_spec_path(args.out):  # the RunSpec of the plan, its search report beside it
            write_spec(args.spec, Plan(data), args.out)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(summary(prob, result))
        if args.out:
            from pipewright.plan.run_toml import is_spec_path, report_path

            print(f"wrote {args.out}" + (f" and {report_path(args.out)}" if is_spec_path(args.out) else ""))
    if args.export:
        _export(data, args)
    return 0


def _export(data: dict, args: argparse.Namespace) -> None:
    """``--export``: the plan for Megatron-LM or torchtitan, printed or written beside ``-o``."""
    import tempfile
    from pathlib import Path

    from pipewright.cli.export_plan import SUFFIX, export
    from pipewright.plan.export import TORCH_SCHEDULES

    if args.out:
        target = Path(args.out).with_suffix("").with_suffix(SUFFIX[args.export])
        from pipewright.plan.run_toml import report_path

        report = report_path(args.out)
        for path in export(report, args.export, target, overwrite=True)[1]:  # checked before the search
            print(f"wrote {path}")
        return
    with tempfile.TemporaryDirectory() as folder:  # the plan file the exporter reads
        from pipewright.plan.planfile import save

        path = Path(folder) / "plan.json"
        save(data, path)
        print(export(path, args.export, write_csv=False)[0], end="")
    if args.export == "torchtitan" and data["schedule"] not in TORCH_SCHEDULES:
        print(f"# note: {data['schedule']}.schedule.csv is written with -o (or by `pipewright export-plan`)")
