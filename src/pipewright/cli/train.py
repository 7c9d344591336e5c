"""``pipewright train``: train a GPT with pipeline (and data) parallelism on torch.distributed.

Values come from the defaults of :class:`~pipewright.runtime.config.TrainConfig`, then ``--config
FILE.toml`` (top-level keys or a ``[train]`` table, named like the flags), then the flags. Without
arguments it trains a small model on the default corpus with two local worker processes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipewright.errors import ConfigError

# flag → (type, help); the destination is the TrainConfig field of the same name.
_VALUE_FLAGS: tuple[tuple[str, type, str], ...] = (
    (
        "--model",
        str,
        "preset (default gpt-small-cpu; gpt-tiny, llama-tiny, gpt3-*, llama3-*) or family gpt|llama",
    ),
    ("--layers", int, "transformer layers"),
    ("--hidden", int, "hidden size h"),
    ("--heads", int, "attention heads"),
    ("--kv-heads", int, "key/value heads (grouped-query attention, Llama; default: --heads)"),
    ("--ffn-hidden", int, "MLP hidden size (default 4h)"),
    ("--vocab", int, "vocabulary size (default: the dataset's)"),
    ("--seq-len", int, "sequence length"),
    ("--layout", str, "stage layout, e.g. 'Et*2|t*2L' (default: uniform)"),
    ("--data", str, "token file (.bin/.npy), text file or folder (default: built-in corpus)"),
    ("--tokenizer", str, "byte or bpe:N (for text data)"),
    ("--tp", int, "tensor-parallel size"),
    ("--pp", int, "pipeline-parallel size"),
    ("--dp", int, "data-parallel size"),
    ("--virtual", int, "model chunks per pipeline rank"),
    ("--schedule", str, "schedule name or PyTorch schedule CSV"),
    ("--microbatches", int, "microbatches per data-parallel replica"),
    ("--microbatch-size", int, "sequences per microbatch"),
    ("--steps", int, "training steps"),
    ("--lr", float, "peak learning rate"),
    ("--warmup", int, "warm-up steps"),
    ("--optimizer", str, "adamw, sgd or kfac (K-FAC in the pipeline bubbles)"),
    ("--kfac-base", str, "with --optimizer kfac: the update it feeds, sgd, adamw (default) or lamb"),
    ("--kfac-fill", str, "with --optimizer kfac: measured (tasks that fit a bubble) or all (reproducible)"),
    ("--weight-policy", str, "async schedules: none, stash, 2bw, predict, dc or nesterov (default stash)"),
    ("--async-window", int, "asynchronous schedules: steps per flush-free window (default 10)"),
    ("--seed", int, "seed for weights and data order"),
    ("--out", str, "output folder (default runs/<timestamp>)"),
    ("--stop-after", int, "stop (with a checkpoint) after N steps; continue later with --resume"),
    ("--checkpoint-every", int, "save a checkpoint every N steps (0: only at the end)"),
    ("--eval-every", int, "validation loss every N steps (0: never)"),
    ("--recv-timeout", float, "seconds a receive may wait before the run fails (with a hang report)"),
    ("--collective-timeout", float, "seconds a collective may wait before the run fails (hang report)"),
    ("--keep-checkpoints", int, "keep only the newest K checkpoints (0: all)"),
    ("--max-restarts", int, "restart the workers from the latest checkpoint up to N times after a failure"),
    ("--on-nonfinite", str, "stop or skip: what a NaN/inf loss or gradient does to its step"),
    (
        "--on-save-error",
        str,
        "stop, retry or skip: what a failed checkpoint save does (the last one is kept)",
    ),
    ("--recompute", str, "activation recomputation: none, selective (attention core) or full (per layer)"),
    (
        "--precision",
        str,
        "fp32, bf16 or fp16 (fp32 master weights and optimizer state; fp16 with loss scaling)",
    ),
    (
        "--cpu-allocator",
        str,
        "retain (default: CPU workers keep freed tensor memory, no page-fault storms) or system",
    ),
    ("--init-from", str, "Hugging Face checkpoint folder (GPT-2 or Llama config.json + safetensors)"),
)

# store-true flags → TrainConfig field
_SWITCHES: tuple[tuple[str, str], ...] = (
    ("--overwrite", "an --out that holds a run: move that run aside (to <out>.replaced-<time>), start anew"),
    ("--shard-optimizer", "ZeRO-1: each data-parallel rank keeps 1/dp of the optimizer state"),
    ("--tie-embeddings", "tie the output layer to the input embedding (also across pipeline stages)"),
    ("--reduce-fp32", "with --precision bf16/fp16: sum data-parallel gradients in fp32"),
    ("--kfac-opportunistic", "with --optimizer kfac: also run pending K-FAC tasks while a receive waits"),
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train a GPT with pipeline parallelism")
    parser.add_argument("--config", help="TOML file with training options (flags override it)")
    parser.add_argument("--nproc", type=int, help="processes to start (default tp × pp × dp)")
    parser.add_argument("--plan", help="a `pipewright plan` file: its layout, degrees, schedule, batch")
    for flag, kind, text in _VALUE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    for flag, text in _SWITCHES:
        parser.add_argument(flag, action="store_true", default=None, help=text)
    parser.add_argument(
        "--resume", action="store_true", default=None, help="continue from --out's checkpoint"
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="with --tp: split LayerNorm/residual regions and stage boundaries along the sequence",
    )
    parser.add_argument(
        "--scatter-gather",
        action="store_true",
        default=None,
        help="with --tp (not with --sequence-parallel): each tp rank sends 1/t of a stage boundary",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    parser.add_argument(
        "--no-artifacts", dest="artifacts", action="store_false", default=None, help="no PNG/trace"
    )
    parser.add_argument(
        "--compare-sim",
        action="store_true",
        help="after training, compare the step time with the simulator's prediction (compare.json/png)",
    )
    parser.add_argument(
        "--profile", help="profile CSV for --compare-sim (default: profile the model first, in-process)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything (flags, data, schedule, layout, --out, memory/time estimate); start no worker",
    )
    from pipewright.features import builtin_features

    builtin_features().add_options("train", parser)  # features' flags (--vocab-parallel): TrainConfig fields
    parser.set_defaults(func=_train)


def config_from_args(args: argparse.Namespace):
    from pipewright.runtime.config import TrainConfig

    config = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    if getattr(args, "plan", None):
        from pipewright.plan.apply import train_overrides

        config = config.with_overrides(**train_overrides(args.plan, args))
    names = [flag.lstrip("-").replace("-", "_") for flag, _, _ in _VALUE_FLAGS]
    values = {name: getattr(args, name) for name in names}
    values["recv_timeout_s"] = values.pop("recv_timeout")
    values["collective_timeout_s"] = values.pop("collective_timeout")
    values.update(
        {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in _SWITCHES}
    )
    from dataclasses import fields

    taken = set(values) | {"resume", "progress", "artifacts", "sequence_parallel", "scatter_gather"}
    for f in fields(config):  # flags the features added (default None: not given)
        if f.name not in taken and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    config = config.with_overrides(
        **values,
        resume=args.resume,
        progress=args.progress,
        artifacts=args.artifacts,
        sequence_parallel=args.sequence_parallel,
        scatter_gather=args.scatter_gather,
    )
    if args.nproc is not None and args.nproc != config.world_size:
        raise ConfigError(
            f"--nproc {args.nproc} but tp × pp × dp = {config.tp}×{config.pp}×{config.dp} = "
            f"{config.world_size}; make them equal"
        )
    return config


def _train(args: argparse.Namespace) -> int:
    from pipewright.runtime.trainer import train

    config = config_from_args(args)
    plan = None
    if args.profile is not None and not args.compare_sim:
        raise ConfigError("--profile is used by --compare-sim; add --compare-sim")
    if args.dry_run:
        from pipewright.cli.train_check import dry_run

        return dry_run(config, profile=args.profile)
    if args.compare_sim:
        from pipewright.runtime.compare import plan_comparison

        plan = plan_comparison(config, args.profile, progress=config.progress)
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
