"""Checks the schedule commands run before building anything: values in range, flags that would be
ignored, and the size of what would be built (``--max-actions``).

Size estimate: a schedule of p ranks, v chunks per rank and m microbatches has at most 3·p·v·m compute
actions (F, B and W per chunk and microbatch; lowering adds a send and a receive per boundary pass),
times the iterations simulated; ``schedule show`` prints a grid of p rows and about 3·v·m + 2p columns.
Memory and time grow linearly with both (about 8 s and 0.5 GB per million lowered actions for
``simulate --cost unit`` on a 2-core CPU), so above ``--max-actions`` the commands refuse in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipewright.errors import ConfigError
from pipewright.outputs import check_outputs, size_text
from pipewright.values import POSITIVE, POSITIVE_REAL, check_finite, check_values

if TYPE_CHECKING:
    from pipewright.runspec import RunSpec

#: a model's dimensions as flags (``resolve_model``'s overrides)
_MODEL_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")

_SIZES = (
    "--stages",
    "--microbatches",
    "--virtual",
    *(f"--{d.replace('_', '-')}" for d in _MODEL_DIMS),
    "--nodes",
    "--gpus-per-node",
    "--tp",
    "--dp",
    "--microbatch-size",
    "--global-batch-size",
    "--iterations",
)

#: settings that only a cost model reads: with unit costs they would be ignored
_MODEL_ONLY = (
    ("cluster", "topology"),
    ("cluster", "gpu"),
    ("precision", "dtype"),
    ("parallelism", "rank_order"),
    ("framework", "grad_reduce"),
    ("batch", "microbatch_size"),
    ("batch", "global_batch_size"),
    ("parallelism", "sequence_parallel"),
    ("cluster", "nodes"),
    ("cluster", "gpus_per_node"),
    ("memory", "recompute"),
    ("memory", "recompute_method"),
    ("memory", "recompute_num_layers"),
    ("framework", "name"),
    *(("model", d) for d in _MODEL_DIMS),
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


def check_devices(spec: RunSpec, limit: int, command: str) -> None:
    """One line, before the cluster is built, when --nodes × --gpus-per-node exceeds ``limit`` (no
    --topology file: its size is what its author made) or a fixed degree exceeds the device count."""
    c = spec.cluster
    nodes, per = c.nodes, c.gpus_per_node
    if c.topology or not isinstance(nodes, int) or not isinstance(per, int):
        return
    devices = nodes * per
    if devices > limit:
        most = max(limit // max(per, 1), 1)
        raise ConfigError(
            f"--nodes {nodes:,} × --gpus-per-node {per} = {devices:,} devices, more "
            f"than the {limit:,} `pipewright {command}` builds; use --nodes {most:,} or fewer"
        )
    for dim in ("tp", "pp", "dp", "cp"):
        value = getattr(spec.parallelism, dim)
        if isinstance(value, int) and value > devices:
            raise ConfigError(
                f"--{dim} {value:,} is more than the {devices:,} devices of --nodes {nodes} × "
                f"--gpus-per-node {per}; use --{dim} {devices:,} or less, or more --nodes"
            )


def compute_actions(stages: int, microbatches: int, virtual: int | None, iterations: int = 1) -> int:
    """Upper bound on compute actions: F, B and W per chunk and microbatch (see the module docstring)."""
    return 3 * stages * (virtual or 1) * microbatches * iterations


def check_schedule_command(spec: RunSpec, *, grid: bool) -> None:
    """``schedule show|export``: sizes at least 1, then the estimate (grid cells for ``show``)."""
    par, m, limit = spec.parallelism, spec.batch.microbatches, spec.simulation.max_actions
    sizes = {"--stages": par.pp, "--microbatches": m, "--virtual": par.virtual}
    check_values(sizes, dict.fromkeys(sizes, POSITIVE))
    p, v = par.pp, par.virtual or 1
    if grid:
        cells = p * (3 * v * m + 2 * p)
        check_size(f"the grid of {p:,} ranks × ~{3 * v * m + 2 * p:,} steps (cells)", cells, limit)
    check_size("the schedule's action count", compute_actions(p, m, v), limit)


def check_simulate(spec: RunSpec) -> None:
    """``simulate``: every number finite and in range, no setting silently ignored, a CSV schedule
    agreeing with --stages/--microbatches/--virtual, and the size estimate under --max-actions."""
    from pipewright.cli.spec_args import flag_values

    out, c, par, b = spec.output, spec.cluster, spec.parallelism, spec.batch
    inputs = [spec.schedule.name, c.profile, c.topology, c.calibration, par.plan]
    check_outputs([(out.png, "--png"), (out.trace, "--trace")], overwrite=out.overwrite, inputs=inputs)
    if out.png is not None and out.png == out.trace:
        raise ConfigError(f"--png and --trace both name {out.png}; give two files")
    check_finite(flag_values(spec, "simulate"))
    check_values(_simulate_sizes(spec), {n: POSITIVE for n in _SIZES} | {"--cores": POSITIVE_REAL})
    if spec.model.model is not None:
        check_devices(spec, SIMULATE_MAX_DEVICES, "simulate")
    if spec.model.model is None and c.profile is None and not par.plan:
        _check_unit(spec)
    name = spec.schedule.name
    if name and name.endswith(".csv") and Path(name).is_file():
        _check_csv_agrees(spec)
        return  # the file's size is what it is: it was written by someone who built it
    if name is None:
        return
    m = b.microbatches
    if m is None and b.global_batch_size is not None:
        m = max(1, b.global_batch_size // ((b.microbatch_size or 1) * par.dp))
    if par.pp is not None and m is not None:
        estimate = compute_actions(par.pp, m, par.virtual, spec.simulation.iterations)
        check_size("the simulated schedule's action count", estimate, spec.simulation.max_actions)


def _simulate_sizes(spec: RunSpec) -> dict[str, object]:
    """The counts ``simulate`` takes, by flag, and ``--cores``."""
    m, c, par, b = spec.model, spec.cluster, spec.parallelism, spec.batch
    return {
        "--stages": par.pp,
        "--microbatches": b.microbatches,
        "--virtual": par.virtual,
        **{f"--{d.replace('_', '-')}": getattr(m, d) for d in _MODEL_DIMS},
        "--nodes": c.nodes,
        "--gpus-per-node": c.gpus_per_node,
        "--tp": par.tp,
        "--dp": par.dp,
        "--microbatch-size": b.microbatch_size,
        "--global-batch-size": b.global_batch_size,
        "--iterations": spec.simulation.iterations,
        "--cores": c.cores,
    }


def _check_unit(spec: RunSpec) -> None:
    """Unit costs (no model, profile or plan): one line naming the cost-model settings it would
    ignore."""
    from pipewright.runspec import defaults, values

    given, start = values(spec), values(defaults("simulate"))
    ignored = [path for path in _MODEL_ONLY if given[path] != start[path]]
    if ignored:
        from pipewright.runspec.run import spec_fields

        flags = {p: f.metadata["flag"] for p, f, _ in spec_fields({})}
        raise ConfigError(
            f"unit costs (no --model or --profile) ignore {', '.join(flags[p] for p in ignored)}; drop them, "
            "or give --model for a cost model that uses them"
        )


def _check_csv_agrees(spec: RunSpec) -> None:
    from pipewright.codec import load_csv

    name, par, m = spec.schedule.name, spec.parallelism, spec.batch.microbatches
    sched = load_csv(name)
    v = sched.num_stages // sched.num_ranks
    given = {
        "--stages": (par.pp, sched.num_ranks),
        "--microbatches": (m, sched.num_microbatches),
        "--virtual": (par.virtual, v),
    }
    wrong = [
        f"{flag} {value}" for flag, (value, real) in given.items() if value is not None and value != real
    ]
    if wrong:
        raise ConfigError(
            f"--schedule {name} has {sched.num_ranks} ranks, {v} chunk(s) per rank and "
            f"{sched.num_microbatches} microbatches; {', '.join(wrong)} disagree(s): drop or correct them"
        )


def profiled_model(run: RunSpec):
    """The model ``profile`` measures: ``--model`` (default gpt-small-cpu) with the dimensions given."""
    from pipewright.models.presets import resolve_model

    m = run.model
    dims = {d: getattr(m, d) for d in _MODEL_DIMS}
    return resolve_model(m.model or "gpt-small-cpu", **dims)


def check_profile(run: RunSpec) -> None:
    """``profile``: the outputs writable and new (or ``--overwrite``), every number finite and in range,
    and one layer's measurement (weights, gradients and AdamW state, 16 bytes a parameter, plus a
    microbatch's activations and logits) within this machine's available memory — all before the
    minutes of measuring."""
    from pipewright.cli.spec_args import flag_values
    from pipewright.cost.activations import runtime_layer_elements
    from pipewright.cost.transformer import layer_parameters
    from pipewright.runtime.setup.size_check import available_bytes

    p, out = run.profiling, run.output
    check_outputs([(out.out, "--out"), (p.calibration, "--calibration")], overwrite=out.overwrite)
    values = flag_values(run, "profile")
    check_finite(values)
    positive = (
        *(f"--{d.replace('_', '-')}" for d in _MODEL_DIMS),
        "--tp",
        "--repeats",
        "--nproc",
        "--workers",
    )
    check_values(values, {n: POSITIVE for n in positive})  # the profiler checks the others itself
    if min(p.microbatch_sizes) < 1 or p.contention < 0 or p.warmup < 0:
        return  # the profiler's own one-line errors
    spec = profiled_model(run)
    b = max(p.microbatch_sizes)
    sbh = spec.seq_len * b * spec.hidden
    need = 16 * layer_parameters(spec) + 4 * sbh * runtime_layer_elements(spec, "none")
    need += 8 * spec.seq_len * b * spec.vocab + 16 * spec.vocab * spec.hidden
    free = available_bytes()
    if free is not None and need * max(p.workers or run.parallelism.tp, 1) > free:
        raise ConfigError(
            f"profiling {spec.name} (h={spec.hidden}, s={spec.seq_len}, V={spec.vocab}, b={b}) needs about "
            f"{size_text(need)} per process, more than the {size_text(free)} available; use "
            "smaller --hidden, --seq-len, --vocab or --microbatch-size"
        )
