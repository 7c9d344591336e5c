"""Checks the schedule commands run before building anything: values in range, flags that would be
ignored, and the size of what would be built (``--max-actions``).

Size estimate: a schedule of p ranks, v chunks per rank and m microbatches has at most 3·p·v·m compute
actions (F, B and W per chunk and microbatch; lowering adds a send and a receive per boundary pass),
times the iterations simulated; ``schedule show`` prints a grid of p rows and about 3·v·m + 2p columns.
Memory and time grow linearly with both (about 8 s and 0.5 GB per million lowered actions for
``simulate --cost unit`` on a 2-core CPU), so above ``--max-actions`` the commands refuse in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.outputs import check_outputs, size_text
from pipewright.values import POSITIVE, POSITIVE_REAL, check_finite, check_values

DEFAULT_MAX_ACTIONS = 2_000_000

#: a model's dimensions as flags (``resolve_model``'s overrides)
_MODEL_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")

_SIZES = (
    "stages",
    "microbatches",
    "virtual",
    *_MODEL_DIMS,
    "nodes",
    "gpus_per_node",
    "tp",
    "pp",
    "dp",
    "microbatch_size",
    "global_batch_size",
    "iterations",
)

# options that only a cost model reads: with unit costs they would be ignored (dest → default)
_MODEL_ONLY = {
    "topology": None,
    "gpu": None,
    "dtype": None,
    "rank_order": None,
    "grad_reduce": None,
    "microbatch_size": None,
    "global_batch_size": None,
    "sequence_parallel": False,
    "nodes": 1,
    "gpus_per_node": 8,
    "recompute": "none",
    "recompute_method": None,
    "recompute_num_layers": None,
    "framework": None,
    **{d: None for d in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")},
}


def add_max_actions(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-actions",
        type=int,
        default=DEFAULT_MAX_ACTIONS,
        help="refuse to build a schedule (or grid) estimated larger than this",
    )


def check_size(what: str, estimate: int, limit: int) -> None:
    """One line when ``estimate`` exceeds ``limit``: the estimate and the flag that raises the limit."""
    if limit < 1:
        raise ConfigError(f"--max-actions must be at least 1 (got {limit})")
    if estimate > limit:
        raise ConfigError(
            f"{what} is about {estimate:,}, more than --max-actions {limit:,}; "
            "use fewer microbatches or stages, or raise --max-actions (memory and time grow with it)"
        )


#: devices ``simulate`` builds a cluster of (--nodes × --gpus-per-node): 16,384 nodes of 8 GPUs build
#: in about 3 s of CPU time; 100,000 nodes took 14 s and 1 GB before a layout was even priced
SIMULATE_MAX_DEVICES = 1 << 17
#: devices ``plan`` searches layouts for: 4,096 nodes of 8 GPUs take about 30 s of CPU time
PLAN_MAX_DEVICES = 1 << 15


def check_devices(args: argparse.Namespace, limit: int, command: str) -> None:
    """One line, before the cluster is built, when --nodes × --gpus-per-node exceeds ``limit`` (no
    --topology file: its size is what its author made) or a fixed degree exceeds the device count."""
    if (
        getattr(args, "topology", None)
        or not isinstance(args.nodes, int)
        or not isinstance(args.gpus_per_node, int)
    ):
        return
    devices = args.nodes * args.gpus_per_node
    if devices > limit:
        most = max(limit // max(args.gpus_per_node, 1), 1)
        raise ConfigError(
            f"--nodes {args.nodes:,} × --gpus-per-node {args.gpus_per_node} = {devices:,} devices, more "
            f"than the {limit:,} `pipewright {command}` builds; use --nodes {most:,} or fewer"
        )
    for dim in ("tp", "pp", "dp", "cp"):
        value = getattr(args, dim, None)
        if isinstance(value, int) and value > devices:
            raise ConfigError(
                f"--{dim} {value:,} is more than the {devices:,} devices of --nodes {args.nodes} × "
                f"--gpus-per-node {args.gpus_per_node}; use --{dim} {devices:,} or less, or more --nodes"
            )


def compute_actions(stages: int, microbatches: int, virtual: int | None, iterations: int = 1) -> int:
    """Upper bound on compute actions: F, B and W per chunk and microbatch (see the module docstring)."""
    return 3 * stages * (virtual or 1) * microbatches * iterations


def check_schedule_command(args: argparse.Namespace, *, grid: bool) -> None:
    """``schedule show|export``: sizes at least 1, then the estimate (grid cells for ``show``)."""
    check_values(vars(args), {n: POSITIVE for n in ("stages", "microbatches", "virtual")})
    p, m, v = args.stages, args.microbatches, args.virtual or 1
    if grid:
        cells = p * (3 * v * m + 2 * p)
        check_size(f"the grid of {p:,} ranks × ~{3 * v * m + 2 * p:,} steps (cells)", cells, args.max_actions)
    check_size("the schedule's action count", compute_actions(p, m, v), args.max_actions)


def check_simulate(args: argparse.Namespace) -> None:
    """``simulate``: every number finite and in range, no flag silently ignored, a CSV schedule
    agreeing with --stages/--microbatches/--virtual, and the size estimate under --max-actions."""
    values = vars(args)
    check_outputs(
        [(args.png, "--png"), (args.trace, "--trace")],
        overwrite=args.overwrite,
        inputs=[getattr(args, n, None) for n in ("schedule", "profile", "topology", "calibration", "plan")],
    )
    if args.png is not None and args.png == args.trace:
        raise ConfigError(f"--png and --trace both name {args.png}; give two files")
    check_finite(values)
    check_values(values, {n: POSITIVE for n in _SIZES} | {"cores": POSITIVE_REAL})
    if args.model is not None:
        check_devices(args, SIMULATE_MAX_DEVICES, "simulate")
    unit = args.model is None and args.profile is None and not getattr(args, "plan", None)
    if unit:
        ignored = [n for n, d in _MODEL_ONLY.items() if values.get(n, d) != d]
        if ignored:
            flags = ", ".join("--" + n.replace("_", "-") for n in ignored)
            raise ConfigError(
                f"unit costs (no --model or --profile) ignore {flags}; drop them, or give --model for a "
                "cost model that uses them"
            )
    name = args.schedule
    if name and name.endswith(".csv") and Path(name).is_file():
        _check_csv_agrees(args)
        return  # the file's size is what it is: it was written by someone who built it
    if name is None:
        return
    p = args.pp if args.pp is not None else args.stages
    m = args.microbatches
    if m is None and args.global_batch_size is not None:
        m = max(1, args.global_batch_size // ((args.microbatch_size or 1) * args.dp))
    if p is not None and m is not None:
        estimate = compute_actions(p, m, args.virtual, args.iterations)
        check_size("the simulated schedule's action count", estimate, args.max_actions)


def _check_csv_agrees(args: argparse.Namespace) -> None:
    from pipewright.codec import load_csv

    sched = load_csv(args.schedule)
    v = sched.num_stages // sched.num_ranks
    given = {
        "--stages": (args.stages, sched.num_ranks),
        "--pp": (args.pp, sched.num_ranks),
        "--microbatches": (args.microbatches, sched.num_microbatches),
        "--virtual": (args.virtual, v),
    }
    wrong = [
        f"{flag} {value}" for flag, (value, real) in given.items() if value is not None and value != real
    ]
    if wrong:
        raise ConfigError(
            f"--schedule {args.schedule} has {sched.num_ranks} ranks, {v} chunk(s) per rank and "
            f"{sched.num_microbatches} microbatches; {', '.join(wrong)} disagree(s): drop or correct them"
        )


def check_profile(args: argparse.Namespace) -> None:
    """``profile``: the outputs writable and new (or ``--overwrite``), every number finite and in range,
    and one layer's measurement (weights, gradients and AdamW state, 16 bytes a parameter, plus a
    microbatch's activations and logits) within this machine's available memory — all before the
    minutes of measuring."""
    from pipewright.cost.activations import runtime_layer_elements
    from pipewright.cost.transformer import layer_parameters
    from pipewright.models.presets import resolve_model
    from pipewright.runtime.setup.size_check import available_bytes

    check_outputs([(args.out, "--out"), (args.calibration, "--calibration")], overwrite=args.overwrite)
    values = vars(args)
    check_finite(values)
    positive = (*_MODEL_DIMS, "tp", "repeats", "nproc", "workers")
    check_values(values, {n: POSITIVE for n in positive})  # the profiler checks the others itself
    if min(args.microbatch_size) < 1 or args.contention < 0 or args.warmup < 0:
        return  # the profiler's own one-line errors
    spec = resolve_model(args.model or "gpt-small-cpu", **{d: values.get(d) for d in _MODEL_DIMS})
    b = max(args.microbatch_size)
    sbh = spec.seq_len * b * spec.hidden
    need = 16 * layer_parameters(spec) + 4 * sbh * runtime_layer_elements(spec, "none")
    need += 8 * spec.seq_len * b * spec.vocab + 16 * spec.vocab * spec.hidden
    free = available_bytes()
    if free is not None and need * max(args.workers or args.tp, 1) > free:
        raise ConfigError(
            f"profiling {spec.name} (h={spec.hidden}, s={spec.seq_len}, V={spec.vocab}, b={b}) needs about "
            f"{size_text(need)} per process, more than the {size_text(free)} available; use "
            "smaller --hidden, --seq-len, --vocab or --microbatch-size"
        )
