"""``pipewright plan``: the fastest layout for a model on a cluster (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from pipewright.cli.guards import PLAN_MAX_DEVICES, check_devices
from pipewright.cli.progress import Bar
from pipewright.cli.spec_args import add_command, required
from pipewright.cli.zb_flags import refine_seconds
from pipewright.errors import ConfigError
from pipewright.outputs import check_output, check_outputs

if TYPE_CHECKING:
    from pipewright.hardware import Accelerator
    from pipewright.models.spec import ModelSpec
    from pipewright.plan.problem import Problem
    from pipewright.plan.profile_input import ProfileInput
    from pipewright.runspec import RunSpec
    from pipewright.topology import Topology

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


def _topology(spec: RunSpec) -> Topology:
    from pipewright.hardware import accelerator
    from pipewright.topology import Topology, cluster, single_host

    c = spec.cluster
    if c.topology:
        return Topology.load(c.topology)
    if not c.gpu:
        raise ConfigError("pipewright plan needs --topology FILE or --gpu KIND with --nodes/--gpus-per-node")
    gpu = accelerator(c.gpu)
    if gpu.name == "cpu":
        return single_host(c.nodes * c.gpus_per_node)
    return cluster(c.nodes, c.gpus_per_node, gpu.name, intra="nvlink" if gpu.nvlink else "pcie4")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} takes comma-separated positive integers (got {text!r})")
    return values


def check_values(spec: RunSpec) -> None:
    """One-line errors for numbers out of range, before any work (and an -o that cannot be written)."""
    import math

    from pipewright.values import POSITIVE, check_values

    c, par, search, m = spec.cluster, spec.parallelism, spec.search, spec.model
    at_least_one = {
        "--global-batch-size": spec.batch.global_batch_size,
        "--nodes": c.nodes,
        "--gpus-per-node": c.gpus_per_node,
        "--max-tp": search.max_tp,
        "--max-cp": search.max_cp,
        "--max-ep": search.max_ep,
        "--finalists": search.finalists,
        "--max-actions": spec.simulation.max_actions,
        **{f"--{d}": getattr(par, d) for d in ("tp", "pp", "dp", "cp", "ep")},
        "--kv-heads": m.kv_heads,
        "--microbatch-group": spec.schedule.microbatch_group,
        **{f"--{d.replace('_', '-')}": getattr(m, d) for d in _DIMS},
    }
    check_values(at_least_one, dict.fromkeys(at_least_one, POSITIVE))
    for flag, value in (("--memory-limit", search.memory_limit), ("--cores", c.cores)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number (got {value})")
    check_plan_outputs(spec)
    check_devices(spec, PLAN_MAX_DEVICES, "plan")


def check_plan_outputs(spec: RunSpec) -> None:
    """``-o`` and the files written beside it (the schedule CSV, ``--export``'s file), before the search."""
    from pipewright.cli.export_plan import SUFFIX
    from pipewright.plan.run_toml import report_path

    o, export = spec.output, spec.search.export
    if o.out is None:
        return
    inputs = [spec.cluster.profile, spec.cluster.topology, spec.cluster.calibration]
    out = check_output(o.out, "-o", overwrite=o.overwrite, inputs=inputs)  # a file name, then:
    paths = [(out.with_suffix(".schedule.csv"), "-o's schedule CSV")]
    if report_path(out) != out:
        paths.append((report_path(out), "-o's search report"))
    if export:
        paths.append((out.with_suffix("").with_suffix(SUFFIX[export]), "-o's --export file"))
    check_outputs(paths, overwrite=o.overwrite, inputs=inputs)


def check_fixed_degrees(spec: RunSpec, devices: int) -> None:
    """The fixed --tp/--pp/--dp/--cp divide the device count (each and together) and --dp the global
    batch; one line naming the flag and values that work, before any layout is priced."""
    par, batch = spec.parallelism, spec.batch.global_batch_size
    fixed = {d: getattr(par, d) for d in ("tp", "pp", "dp", "cp") if getattr(par, d)}
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
    if dp and batch % dp:
        up = -(-batch // dp) * dp
        raise ConfigError(
            f"--global-batch-size {batch} is not a multiple of --dp {dp}; "
            f"use --global-batch-size {up} (or a --dp dividing it)"
        )


def run(args: argparse.Namespace) -> int:
    from pipewright.plan.report import make_plan
    from pipewright.plan.spec_inputs import with_framework_defaults

    given = args.spec  # as the user gave it: what -o RUN.toml writes
    required("plan", **{"--global-batch-size": given.batch.global_batch_size})  # the flags or --config
    spec = with_framework_defaults(given)
    check_values(spec)
    spec, model, profile = _model(spec)
    topo = _topology(spec)
    check_fixed_degrees(spec, len(topo.devices))
    kinds = [topo.accelerator(d) for d in {topo.nodes[x].accelerator: x for x in topo.devices}.values()]
    _check_choices(spec, model, kinds)
    prob = _problem(spec, model, topo, kinds, profile)
    result = make_plan(prob, baselines=not spec.search.no_baselines, progress=Bar(spec.output.progress))
    data = _write(spec, given, prob, result)
    if spec.output.json:
        print(json.dumps(data, indent=1))
    else:
        from pipewright.plan.report import summary
        from pipewright.plan.run_toml import is_spec_path, report_path

        print(summary(prob, result))
        out = spec.output.out
        if out:
            print(f"wrote {out}" + (f" and {report_path(out)}" if is_spec_path(out) else ""))
    if spec.search.export:
        _export(data, spec)
    return 0


def _model(spec: RunSpec) -> tuple[RunSpec, ModelSpec, ProfileInput | None]:
    """The model planned: ``--model``'s, or a ``--profile``'s (whose GPU, dtype and measured microbatch
    sizes then hold, without recomputation), with the spec as the search reads it; and the profile."""
    from pipewright.runspec import with_values
    from pipewright.runspec.model_spec import model_spec

    profile = None
    if spec.cluster.profile is not None:
        if spec.model.model is not None:
            raise ConfigError("give --model or --profile, not both (the profile names its model)")
        from pipewright.cost.profiled import load_profile
        from pipewright.plan.profile_input import ProfileInput

        rows, meta = load_profile(spec.cluster.profile)
        profile = ProfileInput(rows, meta, layers=spec.model.layers)
        model = profile.spec()
        sizes = _ints(spec.search.microbatch_sizes, "--microbatch-sizes")
        chosen = [b for b in profile.microbatch_sizes if b in sizes]
        if not chosen:
            raise ConfigError(
                f"the profile measured microbatch sizes {', '.join(map(str, profile.microbatch_sizes))}; "
                "give one of them in --microbatch-sizes"
            )
        measured = {
            ("cluster", "gpu"): spec.cluster.gpu or meta.get("device", "cpu"),
            ("precision", "dtype"): spec.precision.dtype or meta.get("dtype", "fp32"),
            ("search", "recompute_modes"): "none",
            ("search", "microbatch_sizes"): ",".join(map(str, chosen)),
        }
        spec = with_values(spec, measured)
    elif spec.model.model is None:
        raise ConfigError("pipewright plan needs --model NAME (or --profile FILE)")
    else:
        model = model_spec(spec.model)
    par = spec.parallelism
    if par.ep is not None:
        from pipewright.cost.moe_cost import check_expert_parallel

        if not model.is_moe:
            raise ConfigError("--ep needs a mixture-of-experts model (--moe-experts or a MoE preset)")
        check_expert_parallel(model, par.ep, par.ep if par.dp is None else par.dp)
    if spec.model.moe.imbalance != 1.0 and not model.is_moe:
        raise ConfigError("--moe-imbalance needs a mixture-of-experts model (--moe-experts or a MoE preset)")
    return spec, model, profile


def _check_choices(spec: RunSpec, model: ModelSpec, kinds: list[Accelerator]) -> None:
    """One line for a calibration of another GPU, an unknown schedule, a microbatch group without a
    schedule that groups, a recomputation the model cannot take."""
    from pipewright.cost.partial_recompute import check_partial
    from pipewright.plan.cost_options import check_recompute
    from pipewright.schedules import schedule_names

    if spec.cluster.calibration is not None:
        from pipewright.cost.calibration import load_calibration

        load_calibration(spec.cluster.calibration, kinds[0].name)  # one line if measured on another GPU
    schedules = spec.search.schedules.split(",")
    for name in schedules:
        if name not in schedule_names():
            raise ConfigError(
                f"unknown schedule {name!r} in --schedules; choose from {', '.join(schedule_names())}"
            )
    if spec.schedule.microbatch_group is not None:
        from pipewright.plan.grouping import grouped

        if not any(grouped(name) for name in schedules):
            raise ConfigError(
                "--microbatch-group applies to schedules that group microbatches (interleaved-1f1b); "
                "add one to --schedules"
            )
    modes, memory = spec.search.recompute_modes, spec.memory
    check_recompute(tuple(x for x in modes.split(",") if x), model, spec.framework.attention)
    check_partial(memory.recompute_method, memory.recompute_num_layers, modes)


def _problem(
    spec: RunSpec, model: ModelSpec, topo: Topology, kinds: list[Accelerator], profile: ProfileInput | None
) -> Problem:
    """What the search plans: the model on the topology with the spec's batch, search space, framework
    and cost-model inputs."""
    from pipewright.plan.cost_options import cp_choices, searchable_sharding
    from pipewright.plan.search import Problem
    from pipewright.plan.spec_inputs import (
        cost_fields,
        framework_efficiency,
        recompute_fields,
        tp_comm_overlap,
    )

    search, par, fw = spec.search, spec.parallelism, spec.framework
    dtype = spec.precision.dtype or next(
        (x for x in ("bf16", "fp16", "fp32") if all(x in g.peak_flops for g in kinds)), "fp32"
    )
    schedules = tuple(search.schedules.split(","))
    return Problem(
        model,
        topo,
        spec.batch.global_batch_size,
        dtype=dtype,
        memory_limit=None if search.memory_limit is None else search.memory_limit * 1e9,
        schedules=schedules,
        recompute=tuple(x for x in search.recompute_modes.split(",") if x),
        microbatch_sizes=_ints(search.microbatch_sizes, "--microbatch-sizes"),
        max_tp=search.max_tp,
        finalists=search.finalists,
        fixed=(par.tp, par.pp, par.dp),
        cores=spec.cluster.cores,
        profile=profile,
        max_actions=spec.simulation.max_actions,
        attention=fw.attention,
        cp_choices=cp_choices(len(topo.devices), model.seq_len, par.cp, search.max_cp),
        sharding=searchable_sharding(tuple(x for x in search.optimizer_sharding.split(",") if x)),
        tp_comm_overlap=tp_comm_overlap(spec),
        calibration=spec.cluster.calibration,
        attention_kernel=fw.attention_kernel,
        moe_imbalance=spec.model.moe.imbalance,
        cost_fields=tuple(sorted(cost_fields(spec).items())),
        efficiency=framework_efficiency(spec, kinds),
        framework=fw.name,
        ep=par.ep,
        max_ep=search.max_ep,
        microbatch_group=spec.schedule.microbatch_group,
        zb_refine_seconds=refine_seconds(spec.schedule, schedules),
        recompute_partial=tuple(sorted(recompute_fields(spec).items())),
    )


def _write(spec: RunSpec, given: RunSpec, prob: Problem, result) -> dict:
    """The plan's data; with ``-o``, written (the plan JSON, its schedule CSV, and for a ``.toml`` the
    RunSpec of the plan, from the spec as ``given``, beside its search report)."""
    from pipewright.plan.report import plan_json

    out = spec.output.out
    csv = None
    if out and result.best.schedule is not None:
        from pathlib import Path

        from pipewright.passes.pytorch_csv import to_csv

        csv = Path(out).with_suffix(".schedule.csv")
        csv.write_text(to_csv(result.best.schedule))
    data = plan_json(prob, result, schedule_csv=None if csv is None else csv.name)
    if "full" in (data.get("recompute_per_stage") or [data.get("recompute")]):
        from pipewright.plan.simulated import partial_fields

        # recorded for simulate --plan and the exports, as the finalists were simulated
        data |= partial_fields(prob, result.best.chunk_layers)
    if out:
        from pipewright.plan.planfile import Plan, save
        from pipewright.plan.run_toml import is_spec_path, report_path, write_spec

        save(data, report_path(out))
        if is_spec_path(out):  # the RunSpec of the plan, its search report beside it
            write_spec(given, Plan(data), out)
    return data


def _export(data: dict, spec: RunSpec) -> None:
    """``--export``: the plan for Megatron-LM or torchtitan, printed or written beside ``-o``."""
    import tempfile
    from pathlib import Path

    from pipewright.cli.export_plan import SUFFIX, export
    from pipewright.plan.export import TORCH_SCHEDULES

    out, target = spec.output.out, spec.search.export
    if out:
        from pipewright.plan.run_toml import report_path

        written = Path(out).with_suffix("").with_suffix(SUFFIX[target])
        for path in export(report_path(out), target, written, overwrite=True)[1]:  # checked before the search
            print(f"wrote {path}")
        return
    with tempfile.TemporaryDirectory() as folder:  # the plan file the exporter reads
        from pipewright.plan.planfile import save

        path = Path(folder) / "plan.json"
        save(data, path)
        print(export(path, target, write_csv=False)[0], end="")
    if target == "torchtitan" and data["schedule"] not in TORCH_SCHEDULES:
        print(f"# note: {data['schedule']}.schedule.csv is written with -o (or by `pipewright export-plan`)")
