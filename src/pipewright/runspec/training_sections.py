"""RunSpec sections. Training steps, optimizer, data, checkpoints, and what commands write. Each field is
declared once (:func:`~pipewright.runspec.fields.spec_field`): type, default, flag, help, the commands
that take it. Pure Python.
"""

from __future__ import annotations

from pipewright.runspec.choices import OnNonfinite, OnSaveError
from pipewright.runspec.fields import COMMANDS, TRAINING, section, spec_field, subsection

_REPLACE_RUN = "an --out that holds a run: move that run aside (to <out>.replaced-<time>), start anew"


#: The commands that write a file (all but ``schedule show``).
_WRITERS = tuple(c for c in COMMANDS if c != "schedule show")


@section
class CheckpointSection:
    """Checkpoints, evaluation and reliability of a training run (``[training.checkpoints]``)."""

    every: int = spec_field(
        0,
        "--checkpoint-every",
        "save a checkpoint every N steps (0: only at the end)",
        commands=TRAINING,
    )
    resume: bool = spec_field(
        False,
        "--resume",
        "continue from --out's checkpoint",
        commands=TRAINING,
    )
    stop_after: int | None = spec_field(
        None,
        "--stop-after",
        "stop (with a checkpoint) after N steps; continue later with --resume",
        commands=TRAINING,
    )
    eval_every: int = spec_field(
        50,
        "--eval-every",
        "validation loss every N steps (0: never)",
        commands=TRAINING,
    )
    recv_timeout_s: float = spec_field(
        300.0,
        "--recv-timeout",
        "seconds a receive may wait before the run fails (with a hang report)",
        commands=TRAINING,
    )
    collective_timeout_s: float = spec_field(
        600.0,
        "--collective-timeout",
        "seconds a collective may wait before the run fails (hang report)",
        commands=TRAINING,
    )
    keep: int = spec_field(
        0,
        "--keep-checkpoints",
        "keep only the newest K checkpoints (0: all)",
        commands=TRAINING,
    )
    max_restarts: int = spec_field(
        0,
        "--max-restarts",
        "restart the workers from the latest checkpoint up to N times after a failure",
        commands=TRAINING,
    )
    eval_batches: int = spec_field(2, None, "validation batches per evaluation", minimum=1)
    on_nonfinite: OnNonfinite = spec_field(
        "stop",
        "--on-nonfinite",
        "stop or skip: what a NaN/inf loss or gradient does to its step",
        commands=TRAINING,
    )
    on_save_error: OnSaveError = spec_field(
        "stop",
        "--on-save-error",
        "stop, retry or skip: what a failed checkpoint save does (the last one is kept)",
        commands=TRAINING,
    )


@section
class TrainingSection:
    """Steps, optimizer and data of a training run (``[training]``); checkpoints and reliability in
    ``[training.checkpoints]``."""

    seed: int = spec_field(
        0,
        "--seed",
        "seed for weights and data order",
        commands=TRAINING,
    )
    data: str | None = spec_field(
        None,
        "--data",
        "token file (.bin/.npy), text file or folder",
        commands=TRAINING,
    )
    tokenizer: str = spec_field(
        "byte",
        "--tokenizer",
        "byte or bpe:N (for text data)",
        commands=TRAINING,
    )
    steps: int = spec_field(
        200,
        "--steps",
        "training steps",
        commands=TRAINING,
        minimum=1,
    )
    lr: float = spec_field(
        0.003,
        "--lr",
        "peak learning rate",
        commands=TRAINING,
    )
    warmup: int = spec_field(
        20,
        "--warmup",
        "warm-up steps",
        commands=TRAINING,
    )
    optimizer: str = spec_field(
        "adamw",
        "--optimizer",
        "adamw or sgd, or an optimizer a feature provides",
        commands=("train", "check", "profile"),
        variants={"profile": {"help": "optimizer whose step is timed"}},
    )
    min_lr_ratio: float = spec_field(0.1, None, "the cosine schedule's floor, a fraction of --lr")
    weight_decay: float = spec_field(0.1, None, "decoupled weight decay (AdamW)")
    grad_clip: float = spec_field(1.0, None, "the gradients' global norm is clipped to this")
    checkpoints: CheckpointSection = subsection(CheckpointSection)


@section
class OutputSection:
    """What a command writes and prints (``[output]``)."""

    json: bool = spec_field(
        False,
        "--json",
        "print the metrics as JSON",
        commands=("simulate", "plan", "calibrate"),
        variants={"plan": {"help": "print the plan JSON"}, "calibrate": {"help": "print the report as JSON"}},
    )
    png: str | None = spec_field(
        None,
        "--png",
        "write the timeline picture to this PNG file",
        commands=("simulate",),
    )
    trace: str | None = spec_field(
        None,
        "--trace",
        "write a Chrome/Perfetto trace JSON to this file",
        commands=("simulate",),
    )
    overwrite: bool = spec_field(
        False,
        "--overwrite",
        ("replace an existing output file (or one that is also an input); refused without it"),
        commands=_WRITERS,
        variants={"train": {"help": _REPLACE_RUN}, "check": {"help": _REPLACE_RUN}},
    )
    progress: bool = spec_field(
        True,
        "--no-progress",
        "no progress bar",
        commands=("plan", "train", "check", "profile", "calibrate"),
    )
    out: str | None = spec_field(
        None,
        "--out",
        "output folder (default runs/<timestamp>)",
        commands=tuple(c for c in _WRITERS if c != "simulate"),  # (simulate: --png, --trace)
        variants={
            "schedule export": {"aliases": ("-o", "--output"), "help": "file to write"},
            "data prepare": {
                "aliases": ("-o", "--output"),
                "help": "token file to write (.bin + .json sidecar)",
            },
            "plan": {"aliases": ("-o",), "help": "write the plan JSON to this file"},
            "export-plan": {"aliases": ("-o",), "help": "write to this file instead of printing"},
            "profile": {"help": "profile file to write (.csv or .json)"},
            "calibrate": {"help": "the calibration file to write (JSON)"},
        },
    )
    artifacts: bool = spec_field(
        True,
        "--no-artifacts",
        "no loss.png, timeline.png or trace.json",
        commands=TRAINING,
    )
    compare_sim: bool = spec_field(
        False,
        "--compare-sim",
        ("after training, compare the step time with the simulator's prediction (compare.json/png)"),
        commands=("train",),
    )
    dry_run: bool = spec_field(
        False,
        "--dry-run",
        ("check everything (flags, data, schedule, layout, --out, memory/time estimate); start no worker"),
        commands=("train",),
    )
    measure: bool = spec_field(
        False,
        "--measure",
        (
            "(train: with --dry-run) run one step of every distinct rank at full size on meta "
            "tensors and compare its peak memory, FLOPs and bytes with the simulator's"
        ),
        commands=TRAINING,
    )
    measure_ranks: tuple[int, ...] | None = spec_field(
        None,
        "--measure-ranks",
        "with --measure: only these pipeline ranks",
        commands=TRAINING,
    )
    measure_json: bool = spec_field(
        False,
        "--measure-json",
        "with --measure: print JSON",
        commands=TRAINING,
    )
