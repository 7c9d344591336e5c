"""``pipewright train``: train a GPT with pipeline (and data) parallelism on torch.distributed.

Values come from the defaults of :class:`~pipewright.runtime.config.TrainConfig` and of the features'
option sections, then ``--config FILE.toml`` (top-level keys or a ``[train]`` table, named like the
flags, and a feature's ``[table]``), then ``--plan``, then the flags. Without arguments it trains a
small model on the default corpus with two local worker processes. ``--feature module:attr`` (or an
installed ``pipewright.features`` entry point) adds a feature of your own: its flags, its TOML table
and its training plugin.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.optim import OPTIMIZERS

# help group → ((flag, type, help), ...); the destination is the TrainConfig field of the same name
# (``--recv-timeout`` → ``recv_timeout_s``); type None: a store-true switch
_GROUPS: tuple[tuple[str, tuple[tuple[str, type | None, str], ...]], ...] = (
    (
        "model",
        (
            (
                "--model",
                str,
                "preset (gpt-tiny, gpt-small-cpu, llama-tiny, gpt3-*, llama3-*) or family gpt|llama",
            ),
            ("--layers", int, "transformer layers (default: the preset's)"),
            ("--hidden", int, "hidden size h (default: the preset's)"),
            ("--heads", int, "attention heads (default: the preset's)"),
            ("--kv-heads", int, "key/value heads (grouped-query attention, Llama; default: --heads)"),
            ("--ffn-hidden", int, "MLP hidden size (default 4h)"),
            ("--vocab", int, "vocabulary size (default: the dataset's)"),
            ("--seq-len", int, "sequence length (default: the preset's)"),
            ("--init-from", str, "Hugging Face checkpoint folder (GPT-2 or Llama config.json + safetensors)"),
            ("--tie-embeddings", None, "tie the output layer to the input embedding (also across stages)"),
        ),
    ),
    (
        "data",
        (
            ("--data", str, "token file (.bin/.npy), text file or folder (default: built-in corpus)"),
            ("--tokenizer", str, "byte or bpe:N (for text data)"),
            ("--seed", int, "seed for weights and data order"),
        ),
    ),
    (
        "layout",
        (
            ("--tp", int, "tensor-parallel size"),
            ("--pp", int, "pipeline-parallel size"),
            ("--dp", int, "data-parallel size"),
            ("--virtual", int, "model chunks per pipeline rank (default: the schedule's)"),
            ("--layout", str, "stage layout, e.g. 'Et*2|t*2L' (default: uniform)"),
            (
                "--sequence-parallel",
                None,
                "with --tp: split LayerNorm/residual regions and boundaries along s",
            ),
            (
                "--scatter-gather",
                None,
                "with --tp (not --sequence-parallel): each tp rank sends 1/t of a boundary",
            ),
        ),
    ),
    (
        "schedule",
        (
            ("--schedule", str, "schedule name or PyTorch schedule CSV"),
            ("--microbatches", int, "microbatches per data-parallel replica"),
            ("--microbatch-size", int, "sequences per microbatch"),
            ("--steps", int, "training steps"),
        ),
    ),
    (
        "optimizer",
        (
            ("--optimizer", str, "the update rule, one of: " + ", ".join(OPTIMIZERS)),
            ("--lr", float, "peak learning rate"),
            ("--warmup", int, "warm-up steps"),
        ),
    ),
    (
        "precision and memory",
        (
            (
                "--precision",
                str,
                "fp32, bf16 or fp16 (fp32 master weights and optimizer state; fp16 loss scaling)",
            ),
            ("--reduce-fp32", None, "with --precision bf16/fp16: sum data-parallel gradients in fp32"),
            ("--shard-optimizer", None, "ZeRO-1: each data-parallel rank keeps 1/dp of the optimizer state"),
            (
                "--recompute",
                str,
                "activation recomputation: none, selective (attention core) or full (per layer)",
            ),
            ("--cpu-allocator", str, "retain (CPU workers keep freed tensor memory) or system"),
        ),
    ),
    (
        "checkpoints and reliability",
        (
            ("--out", str, "output folder (default runs/<timestamp>)"),
            ("--resume", None, "continue from --out's checkpoint"),
            ("--checkpoint-every", int, "save a checkpoint every N steps (0: only at the end)"),
            ("--stop-after", int, "stop (with a checkpoint) after N steps; continue later with --resume"),
            ("--keep-checkpoints", int, "keep only the newest K checkpoints (0: all)"),
            (
                "--max-restarts",
                int,
                "restart the workers from the latest checkpoint up to N times after a failure",
            ),
            ("--on-nonfinite", str, "stop or skip: what a NaN/inf loss or gradient does to its step"),
            ("--recv-timeout", float, "seconds a receive may wait before the run fails (with a hang report)"),
            (
                "--collective-timeout",
                float,
                "seconds a collective may wait before the run fails (hang report)",
            ),
            ("--eval-every", int, "validation loss every N steps (0: never)"),
        ),
    ),
)
_SUFFIXED = {"recv_timeout": "recv_timeout_s", "collective_timeout": "collective_timeout_s"}


def _field(flag: str) -> str:
    name = flag.lstrip("-").replace("-", "_")
    return _SUFFIXED.get(name, name)


def register(sub: argparse._SubParsersAction, feature_paths: tuple[str, ...] = ()) -> None:
    from pipewright.features import all_features
    from pipewright.runtime.config import TrainConfig

    parser = sub.add_parser("train", help="train a GPT with pipeline parallelism")
    parser.add_argument("--config", help="TOML file with training options (flags override it)")
    parser.add_argument("--nproc", type=int, help="processes to start (default tp × pp × dp)")
    parser.add_argument("--plan", help="a `pipewright plan` file: its layout, degrees, schedule, batch")
    parser.add_argument(
        "--feature",
        action="append",
        default=None,
        metavar="MODULE:ATTR",
        help="a feature of your own (a pipewright.features.Feature), repeatable",
    )
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for title, flags in _GROUPS:
        group = parser.add_argument_group(title)
        for flag, kind, text in flags:
            if "default" not in text:  # the value when neither the file nor a flag sets it
                value = defaults[_field(flag)]
                text = f"{text} (default: {'none' if value is None else value})"
            if kind is None:
                group.add_argument(flag, dest=_field(flag), action="store_true", default=None, help=text)
            else:
                group.add_argument(flag, dest=_field(flag), type=kind, default=None, help=text)
    out = parser.add_argument_group("output")
    out.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    out.add_argument(
        "--no-artifacts", dest="artifacts", action="store_false", default=None, help="no PNG/trace"
    )
    out.add_argument(
        "--compare-sim",
        action="store_true",
        help="after training, compare the step time with the simulator's prediction (compare.json/png)",
    )
    out.add_argument("--profile", help="profile CSV for --compare-sim (default: profile the model first)")
    all_features(feature_paths).add_options("train", parser)  # one group per feature (its section)
    parser.set_defaults(func=_train)


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of parsed ``train`` arguments, the features' options resolved (defaults filled
    in; their checks run in :func:`pipewright.training.prepare`)."""
    from pipewright.runtime.config import TrainConfig
    from pipewright.training import resolve_options, run_features

    config = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    paths = tuple(getattr(args, "feature", None) or ())
    if paths:
        config = config.with_overrides(features={**config.features, "feature_paths": paths})
    if getattr(args, "plan", None):
        from pipewright.plan.apply import train_overrides

        config = config.with_overrides(**train_overrides(args.plan, args))
    core = {f.name for f in fields(TrainConfig)} - {"features"}
    config = config.with_overrides(
        **{n: getattr(args, n) for n in core if getattr(args, n, None) is not None}
    )
    features = run_features(config)
    given = {}
    for feature in features:
        if feature.section is not None:
            from pipewright.options import flat_defaults

            given |= {
                n: getattr(args, n)
                for n in flat_defaults(feature.section)
                if getattr(args, n, None) is not None
            }
    config = resolve_options(config.with_overrides(features={**config.features, **given}), features)
    if args.nproc is not None and args.nproc != config.world_size:
        raise ConfigError(
            f"--nproc {args.nproc} but tp × pp × dp = {config.tp}×{config.pp}×{config.dp} = "
            f"{config.world_size}; make them equal"
        )
    return config


def _train(args: argparse.Namespace) -> int:
    from pipewright.training import resolve_schedule, train

    config = config_from_args(args)
    plan = None
    if args.profile is not None and not args.compare_sim:
        raise ConfigError("--profile is used by --compare-sim; add --compare-sim")
    if args.compare_sim:
        from pipewright.runtime.compare import plan_comparison

        plan = plan_comparison(
            config, args.profile, progress=config.progress, schedule=resolve_schedule(config)
        )
    result = train(config)
    if result is None:  # a torchrun rank other than 0
        return 0
    if result.preempted_at is not None:
        from pipewright.runtime.elastic import PREEMPTED_EXIT_CODE

        print(
            f"preempted (SIGTERM) after step {result.preempted_at}: checkpoint in {result.out_dir}; "
            "continue with --resume"
        )
        return PREEMPTED_EXIT_CODE
    first, last = result.losses[0], result.losses[-1]
    print(
        f"trained {len(result.losses)} steps in {result.wall_s:.1f} s: loss {first:.3f} -> {last:.3f}, "
        f"{result.tokens_per_s:,.0f} tokens/s"
    )
    if result.val_losses:
        step, val = max(result.val_losses.items())
        print(f"validation loss {val:.3f} after step {step + 1}")
    if plan is not None:
        from pipewright.runtime.compare import bracket_profile, compare_run, summary

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
