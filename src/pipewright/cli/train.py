"""``pipewright train``: train a GPT with pipeline (and data) parallelism on torch.distributed.

The run is a RunSpec (docs/run-spec.md): ``train``'s defaults, then an older ``--config FILE.toml``
(top-level keys or a ``[train]`` table named like the flags, and a feature's ``[table]``), then the
plan of ``--plan`` (a RunSpec's ``parallelism.plan``), then what the run sets itself: a RunSpec
``--config RUN.toml`` (``pipewright plan -o RUN.toml`` writes one) and the flags
(:func:`pipewright.training.run_inputs.run_spec`); its
:class:`~pipewright.runtime.setup.config.TrainConfig` is :meth:`TrainConfig.from_spec`'s.
Without arguments it trains a small model on the default corpus with two local worker processes.
``--feature module:attr`` (or an installed ``pipewright.features`` entry point) adds a feature of your
own: its flags, its TOML table and its training plugin.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipewright.errors import ConfigError

#: The most routed experts per layer ``train`` builds (one module each).
MAX_EXPERTS = 1 << 16


def register(sub: argparse._SubParsersAction, feature_paths: tuple[str, ...] = ()) -> None:
    from pipewright.cli.spec_args import add_command
    from pipewright.features import all_features
    from pipewright.runspec import feature_sections

    add_command(
        sub,
        "train",
        _train,
        feature_sections(all_features(feature_paths)),  # one group per feature (its section)
        help="train a model with pipeline parallelism",
    )


def config_from_args(args: argparse.Namespace, command: str = "train"):
    """The TrainConfig of parsed ``train`` (or ``check``) arguments: their RunSpec with the older inputs
    (:func:`pipewright.training.run_inputs.run_spec`), the features' options resolved (their checks run
    in :func:`pipewright.training.prepare`), dp from the processes when no input sets it."""
    from pipewright.runtime.setup.config import TrainConfig
    from pipewright.training import resolve_options
    from pipewright.training.run_inputs import batch_from_global, check_planned_cluster, run_spec

    spec, chosen = run_spec(args.spec, args.given, command, args.train_toml)
    config = resolve_options(TrainConfig.from_spec(spec))
    nproc, cluster = spec.cluster.nproc, spec.cluster
    if ("parallelism", "dp") not in chosen:
        config = dp_from_processes(config, nproc)
    config = batch_from_global(config, spec.batch.global_batch_size, ("batch", "microbatches") in chosen)
    if {("cluster", "nodes"), ("cluster", "gpus_per_node")} & chosen:
        check_planned_cluster(config, cluster.nodes, cluster.gpus_per_node)
    if nproc is not None and nproc != config.world_size:
        raise ConfigError(
            f"--nproc {nproc} but tp × cp × pp × dp = {config.tp}×{config.cp}×{config.pp}×"
            f"{config.dp} = {config.world_size}; make them equal"
        )
    experts = config.moe_experts or 0
    if experts > MAX_EXPERTS:  # each expert is a module: 10^8 of them exhaust memory before any check
        raise ConfigError(
            f"--moe-experts {experts:,} is more than the {MAX_EXPERTS:,} experts a layer can hold here "
            "(DeepSeek-V3 has 256)"
        )
    return config


def measure_args(spec, dry_run: bool | None = None) -> argparse.Namespace | None:
    """``--measure``'s settings (:func:`pipewright.cli.measure.measure`), None when not asked for."""
    o = spec.output
    if not (o.measure or o.measure_ranks or o.measure_json):
        return None
    ranks = list(o.measure_ranks) if o.measure_ranks else None
    extra = {} if dry_run is None else {"dry_run": dry_run}
    return argparse.Namespace(measure_json=o.measure_json, measure_ranks=ranks, **extra)


def dp_from_processes(config, nproc: int | None):
    """``config`` with dp = processes / (tp · cp · pp) when ``--dp`` was not given, as Megatron-LM and
    torchtitan derive data parallelism from the world size; the processes: ``--nproc``, else torchrun's
    ``WORLD_SIZE``. One-line error when they do not divide."""
    import os

    from pipewright.runtime.setup.launch import running_under_torchrun

    procs = (
        nproc if nproc is not None else int(os.environ["WORLD_SIZE"]) if running_under_torchrun() else None
    )
    model = config.tp * config.cp * config.pp
    if procs is None or model < 1 or procs == model * config.dp:
        return config  # (a degree below 1 is the option checks' one-line error)
    if procs % model:
        given = "--nproc" if nproc is not None else "torchrun's WORLD_SIZE"
        raise ConfigError(
            f"{given} {procs} is not a multiple of tp × cp × pp = {config.tp}×{config.cp}×{config.pp} = "
            f"{model}; start a multiple of {model} processes or give --dp"
        )
    return config.with_overrides(dp=procs // model)


def _train(args: argparse.Namespace) -> int:
    from pipewright.training import prepare, train

    config = config_from_args(args)
    out, profile = args.spec.output, args.spec.cluster.profile
    if sys.stderr.isatty():  # a person waiting: say what the next seconds are for (before the imports)
        print(
            f"preparing: checking the layout and the data, then {config.world_size} worker process(es) "
            "build the model and join the process group",
            file=sys.stderr,
            flush=True,
        )
    plan = prepared = None
    if profile is not None and not out.compare_sim:
        raise ConfigError("--profile is used by --compare-sim; add --compare-sim")
    asked = measure_args(args.spec, out.dry_run)
    if asked is not None:
        from pipewright.cli.measure import measure

        return measure(config, asked)
    if out.dry_run:
        from pipewright.cli.train_check import dry_run

        return dry_run(config, profile=profile)
    if out.compare_sim:
        from pipewright.runtime.profiling.compare import plan_comparison

        prepared = prepare(config)  # checked once, for the comparison and the run
        plan = plan_comparison(prepared.config, profile, progress=config.progress, schedule=prepared.schedule)
    result = train(config, prepared)
    if result is None:  # a torchrun rank other than 0
        return 0
    if result.preempted_at is not None:
        from pipewright.runtime.reliability.elastic import PREEMPTED_EXIT_CODE
        from pipewright.runtime.reliability.interrupts import INTERRUPTED, INTERRUPTED_EXIT_CODE

        why = "interrupted (Ctrl-C)" if INTERRUPTED.is_set() else "preempted (SIGTERM)"
        print(
            f"{why} after step {result.preempted_at}: checkpoint in {result.out_dir}; "
            f"continue with --resume --out {result.out_dir}"
        )
        return INTERRUPTED_EXIT_CODE if INTERRUPTED.is_set() else PREEMPTED_EXIT_CODE
    first, last = result.losses[0], result.losses[-1]
    print(
        f"trained {len(result.losses)} steps in {result.wall_s:.1f} s: loss {first:.3f} -> {last:.3f}, "
        f"{result.tokens_per_s:,.0f} tokens/s"
    )
    if result.val_losses:
        step, val = max(result.val_losses.items())
        print(f"validation loss {val:.3f} after step {step + 1}")
    if plan is not None:
        from pipewright.runtime.profiling.compare import bracket_profile, compare_run, summary

        if plan.source is None:
            print("profiling again after the run (the prediction uses both profiles)", flush=True)
        plan = bracket_profile(plan, progress=config.progress)
    print(f"outputs in {result.out_dir}:")
    if plan is not None:
        print(summary(compare_run(plan, result.out_dir)))
        print(f"  {Path(result.out_dir) / 'compare.json'}")
        print(f"  {Path(result.out_dir) / 'compare.png'}")
    for path in result.files.values():
        print(f"  {Path(path)}")
    return 0
