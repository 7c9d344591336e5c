"""RunSpec sections. Where and how it is split: the cluster and the parallelism. Each field is declared
once (:func:`~pipewright.runspec.fields.spec_field`): type, default, flag, help, the commands that take
it. Pure Python.
"""

from __future__ import annotations

from pipewright.runspec.choices import CostSource, Device
from pipewright.runspec.fields import (
    MODEL_COMMANDS,
    PRICING,
    SCHEDULE,
    TRAINING,
    section,
    spec_field,
    variant_of_each,
)

_PLANNED_GPU = (
    "the accelerator the run is planned for (a `pipewright plan` run's): --dry-run says whether each "
    "process's estimated memory fits it"
)
_PLANNED_DEVICES = (
    "{} of the cluster the run is planned for: given, the processes (tp × cp × pp × dp) must be "
    "nodes × gpus-per-node"
)


@section
class ClusterSection:
    """The hardware and where the costs come from: GPU kind, nodes, topology, a measured calibration or
    profile, processes (``[cluster]``)."""

    cost: CostSource | None = spec_field(
        None,
        "--cost",
        "unit: F=1, B=2, I=W=1 per chunk-microbatch, free communication",
        commands=("simulate",),
    )
    profile: str | None = spec_field(
        None,
        "--profile",
        (
            "measured costs: a `pipewright profile` file (with --schedule, --stages, "
            "--microbatches; --microbatch-size and --layers default to the profile's)"
        ),
        commands=("simulate", "plan", "train"),
        variants={
            "plan": {
                "help": "plan from a `pipewright profile` table (CSV or JSON) instead of --model: measured "
                "times, the profile's model, tp and microbatch sizes, no recomputation"
            },
            "train": {"help": "profile CSV for --compare-sim (default: profile the model first)"},
        },
    )
    cores: float | None = spec_field(
        None,
        "--cores",
        (
            "the ranks (× tp × dp processes) share this many CPU cores: processor sharing, "
            "with the profile's contention curve when it has one"
        ),
        commands=PRICING,
    )
    gpu: str | None = spec_field(
        None,
        "--gpu",
        ("accelerator kind: v100, a100-40gb, a100-80gb, h100-sxm, h100-pcie, h800, h200, b200, cpu"),
        commands=("simulate", "plan", "profile", "calibrate", *TRAINING),
        variants={
            "train": {"help": _PLANNED_GPU},
            "check": {"help": _PLANNED_GPU},
            "profile": {
                "help": "with --calibration: the hardware preset of this GPU when its name maps to none"
            },
            "calibrate": {"help": "the GPU the runs were measured on (a preset)"},
        },
    )
    nodes: int = spec_field(
        1,
        "--nodes",
        "machines in the cluster",
        commands=(*PRICING, *TRAINING),
        variants={t: {"help": _PLANNED_DEVICES.format("machines")} for t in TRAINING},
        minimum=1,
    )
    gpus_per_node: int = spec_field(
        8,
        "--gpus-per-node",
        "GPUs per machine",
        commands=("simulate", "plan", "calibrate", *TRAINING),
        variants={t: {"help": _PLANNED_DEVICES.format("GPUs per machine")} for t in TRAINING},
        minimum=1,
    )
    calibration: str | None = spec_field(
        None,
        "--calibration",
        "a measured calibration (`pipewright profile --calibration`) of --gpu",
        commands=PRICING,
    )
    topology: str | None = spec_field(
        None,
        "--topology",
        "cluster topology JSON",
        commands=PRICING,
    )
    nproc: int | None = spec_field(
        None,
        "--nproc",
        "processes to start (default tp × cp × pp × dp)",
        commands=("train", "check", "profile"),
        minimum=1,
        variants={
            "profile": {
                "default": 1,
                "help": "with --calibration: processes to spawn for the links (default 1)",
            }
        },
    )
    device: Device = spec_field(
        "cpu",
        "--device",
        "the device profiled: cpu or cuda",
        commands=("profile",),
    )


@section
class ParallelismSection:
    """How the model is split: tensor, pipeline, data, context and expert sizes, virtual chunks, the layout
    (Megatron-Core's layout language, :mod:`pipewright.models.layout_text`) and the mapping onto devices
    (rank order, a plan's device order) (``[parallelism]``)."""

    pp: int | None = spec_field(
        None,
        "--pp",
        "pipeline-parallel size",
        commands=(*MODEL_COMMANDS, *SCHEDULE),
        minimum=1,
        variants={
            "simulate": {"aliases": ("--stages", "-p")},
            **variant_of_each(SCHEDULE, aliases=("--stages", "-p"), help="pipeline ranks p"),
            "train": {"default": 2},
            "check": {"default": 2},
        },
    )
    virtual: int | None = spec_field(
        None,
        "--virtual",
        "model chunks per pipeline rank",
        commands=("simulate", "train", "check", *SCHEDULE),
        minimum=1,
        variants={"simulate": {"aliases": ("-v",)}, **variant_of_each(SCHEDULE, aliases=("-v",))},
    )
    tp: int | None = spec_field(
        1,
        "--tp",
        "tensor-parallel size",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
        variants={
            "plan": {"default": None, "help": "fix tp (default: searched)"},
            "profile": {"help": "tensor-parallel size (spawns tp processes)"},
        },
    )
    dp: int | None = spec_field(
        1,
        "--dp",
        "data-parallel size",
        commands=MODEL_COMMANDS,
        minimum=1,
        variants={"plan": {"default": None, "help": "fix dp"}},
    )
    cp: int | None = spec_field(
        1,
        "--cp",
        "context-parallel size: ring attention over 2·cp sequence chunks",
        commands=MODEL_COMMANDS,
        minimum=1,
        variants={"plan": {"default": None, "help": "fix the context-parallel size"}},
    )
    ep: int | None = spec_field(
        1,
        "--ep",
        "expert-parallel size (divides --dp and the experts)",
        commands=MODEL_COMMANDS,
        minimum=1,
        variants={
            "plan": {"default": None, "help": ("fix the expert-parallel size of a mixture of experts")}
        },
    )
    layout: str | None = spec_field(
        None,
        "--layout",
        "stage layout, e.g. 'Et*2|t*2L'",
        commands=("simulate", "train", "check"),
    )
    sequence_parallel: bool = spec_field(
        False,
        "--sequence-parallel",
        "with --tp: split LayerNorm/residual regions and boundaries along s",
        commands=("simulate", "train", "check"),
    )
    plan: str | None = spec_field(
        None,
        "--plan",
        "a `pipewright plan` file: its layout, degrees and device order",
        commands=("simulate", "train", "check", "export-plan"),
        variants={
            "export-plan": {
                "positional": "PLAN",
                "help": "a `pipewright plan` file: its JSON, or a RunSpec TOML that names one "
                "(plan -o RUN.toml)",
            }
        },
    )
    placement: str | None = spec_field(
        None, None, "device of each rank, comma-separated (a plan's device order; default rank r on device r)"
    )
    rank_order: str | None = spec_field(
        None,
        "--rank-order",
        "rank order, innermost first (default tp-dp-pp, Megatron's; e.g. tp-pp-dp)",
        commands=("simulate",),
    )
    scatter_gather: bool = spec_field(
        False,
        "--scatter-gather",
        "with --tp (not --sequence-parallel): each tp rank sends 1/t of a boundary",
        commands=TRAINING,
    )
    blocking_pairs: bool = spec_field(
        False,
        "--blocking-pairs",
        ("with --cp or --ep: run the schedule's F&B pairs (dualpipev, 1f1b-overlap) one after the other"),
        commands=TRAINING,
    )
