"""RunSpec sections. Sections one command reads: simulate's run, plan's search space, profile's and
calibrate's measurements, export-plan's target, the user's features, what ``schedule show|export``
prints and writes, ``data prepare``'s text. Each field is declared once
(:func:`~pipewright.runspec.fields.spec_field`): type, default, flag, help, the commands that take it.
Pure Python.
"""

from __future__ import annotations

from pipewright.runspec.choices import ExportTarget, ScheduleFormat, Trainer
from pipewright.runspec.fields import PRICING, SCHEDULE, TRAINING, section, spec_field


@section
class SimulationSection:
    """How ``simulate`` runs and judges the timeline; ``check``'s tolerance (``[simulation]``)."""

    iterations: int = spec_field(
        1,
        "--iterations",
        "iterations to simulate (steady state)",
        commands=("simulate",),
        minimum=1,
    )
    no_step_barrier: bool = spec_field(
        False,
        "--no-step-barrier",
        "no global synchronization at the optimizer step (per-stage ordering only)",
        commands=("simulate",),
    )
    enforce_memory: bool = spec_field(
        False,
        "--enforce-memory",
        "fail when a rank does not fit",
        commands=("simulate",),
    )
    allow_no_fit: bool = spec_field(
        False,
        "--allow-no-fit",
        ("exit 0 even when a rank does not fit its device's memory (DOES NOT FIT; exit 1 without it)"),
        commands=("simulate",),
    )
    max_actions: int = spec_field(
        2000000,
        "--max-actions",
        "refuse to build a schedule (or grid) estimated larger than this",
        commands=(*PRICING, *SCHEDULE),
        minimum=1,
    )
    tolerance: float | None = spec_field(
        None,
        "--tolerance",
        "relative tolerance",
        commands=("check",),
    )


@section
class SearchSection:
    """The design space ``plan`` searches (``[search]``)."""

    max_cp: int = spec_field(
        8,
        "--max-cp",
        (
            "largest context-parallel size searched: powers of two dividing the devices and "
            "splitting the sequence into 2·cp chunks (default %(default)s)"
        ),
        commands=("plan",),
        minimum=1,
    )
    max_ep: int = spec_field(
        64,
        "--max-ep",
        "largest expert-parallel size searched (default %(default)s)",
        commands=("plan",),
        minimum=1,
    )
    optimizer_sharding: str = spec_field(
        "none,zero1",
        "--optimizer-sharding",
        (
            "optimizer-state sharding choices over data parallelism, comma-separated: none, "
            "zero1 (distributed optimizer), fsdp (default %(default)s: what `train` runs)"
        ),
        commands=("plan",),
    )
    memory_limit: float | None = spec_field(
        None,
        "--memory-limit",
        "GB per device",
        commands=("plan",),
    )
    schedules: str = spec_field(
        "1f1b,interleaved-1f1b,zb-h1,zb-auto",
        "--schedules",
        (
            "schedules to consider, comma-separated (zb-auto: Zero Bubble's greedy on the "
            "plan's stage times; default %(default)s)"
        ),
        commands=("plan",),
    )
    recompute_modes: str = spec_field(
        "none,selective,full",
        "--recompute",
        (
            "recomputation choices, comma-separated: none, selective, full, op (torchtitan's "
            "operator-level policy; dense models with flash attention), each also tried per "
            "stage"
        ),
        commands=("plan",),
    )
    microbatch_sizes: str = spec_field(
        "1,2,4,8",
        "--microbatch-sizes",
        "microbatch sizes to consider, comma-separated",
        commands=("plan",),
    )
    max_tp: int = spec_field(
        8,
        "--max-tp",
        "largest tensor-parallel size (default 8)",
        commands=("plan",),
        minimum=1,
    )
    finalists: int = spec_field(
        6,
        "--finalists",
        "candidates simulated in full",
        commands=("plan",),
        minimum=1,
    )
    no_baselines: bool = spec_field(
        False,
        "--no-baselines",
        "skip the baselines",
        commands=("plan",),
    )
    export: Trainer | None = spec_field(
        None,
        "--export",
        (
            "also give the plan as Megatron-LM's arguments or torchtitan's TOML (printed; "
            "with -o, written beside the plan: PLAN.megatron.sh or PLAN.torchtitan.toml)"
        ),
        commands=("plan",),
    )


@section
class ProfilingSection:
    """What ``profile`` measures and how (``[profiling]``)."""

    microbatch_sizes: tuple[int, ...] = spec_field(
        (8,),
        "--microbatch-size",
        "sequences per microbatch (several ok)",
        commands=("profile",),
        minimum=1,
        nargs="+",
    )
    workers: int | None = spec_field(
        None,
        "--workers",
        ("processes measuring at once (default tp); the run's process count includes their contention"),
        commands=("profile",),
        minimum=1,
    )
    contention: int = spec_field(
        0,
        "--contention",
        (
            "also measure how n = 1..N busy processes slow each other on this CPU (the "
            "simulator's core sharing; use the run's process count)"
        ),
        commands=("profile",),
    )
    repeats: int = spec_field(
        10,
        "--repeats",
        "measurements per value (median)",
        commands=("profile",),
        minimum=1,
    )
    warmup: int = spec_field(
        2,
        "--warmup",
        "unmeasured runs before the repeats",
        commands=("profile",),
    )
    calibration: str | None = spec_field(
        None,
        "--calibration",
        (
            "instead of a profile, write a calibration JSON: GEMM time by the model's shapes, "
            "memory bandwidth, and with --nproc N ≥ 2 (or under torchrun) link bandwidth and "
            "latency"
        ),
        commands=("profile",),
    )


@section
class CalibratingSection:
    """``calibrate``'s input and mode (``[calibrating]``)."""

    measured: str | None = spec_field(
        None,
        "--measured",
        "measured runs, CSV (docs/cost-model.md)",
        commands=("calibrate",),
    )
    no_fit: bool = spec_field(
        False,
        "--no-fit",
        "score the registered calibration only",
        commands=("calibrate",),
    )


@section
class ExportSection:
    """``export-plan``'s target trainer (``[export]``)."""

    to: ExportTarget | None = spec_field(
        None,
        "--to",
        "the trainer to export for",
        commands=("export-plan",),
    )


@section
class ExtensionsSection:
    """Features of the user's own loaded by import path (``[extensions]``)."""

    feature: tuple[str, ...] | None = spec_field(
        None,
        "--feature",
        "a feature of your own (a pipewright.features.Feature), repeatable",
        commands=TRAINING,
        nargs="append",
    )


@section
class ScheduleViewSection:
    """What ``schedule show`` prints and ``schedule export`` writes (``[schedule_view]``)."""

    with_comms: bool = spec_field(
        False,
        "--with-comms",
        "show send/receive actions",
        commands=SCHEDULE,
        variants={"schedule export": {"help": "include send/receive actions"}},
    )
    format: ScheduleFormat = spec_field(
        "torch-csv",
        "--format",
        "file format (torch-csv: PyTorch's schedule CSV)",
        commands=("schedule export",),
    )


@section
class DataPrepSection:
    """``data prepare``'s text and tokenizer (``[data_prep]``)."""

    inputs: tuple[str, ...] | None = spec_field(
        None,
        "--inputs",
        "text files or folders (read in path order)",
        commands=("data prepare",),
        nargs="+",
        variants={"data prepare": {"positional": "INPUT"}},
    )
    tokenizer: str | None = spec_field(
        None,
        "--tokenizer",
        "model folder with tokenizer.json (and config.json)",
        commands=("data prepare",),
    )
