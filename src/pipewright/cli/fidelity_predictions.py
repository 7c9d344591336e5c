"""Published runs through ``pipewright simulate`` in-process: the predictions of docs/fidelity.md.

:func:`predict` reads a row's RunSpec (:func:`pipewright.cost.published_specs.published_spec`), runs
it through ``simulate`` (:func:`pipewright.cli.simulate.simulated`: the report ``simulate --json``
prints) and reads predicted tokens/s per GPU (B·s / iteration time / GPUs) and the largest per-rank
peak memory (GiB); the row's command line is ``simulate``'s flags of its spec
(:func:`pipewright.runspec.spec_to_argv`). tools/fidelity.py writes the table, tests/test_fidelity.py
checks it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.cost.fidelity import FIT_ROWS, Run, published_tokens_per_s
from pipewright.cost.published_specs import COMMAND, published_spec
from pipewright.errors import PipewrightError
from pipewright.hardware import accelerator
from pipewright.runspec import spec_to_argv


@dataclass(frozen=True)
class Outcome:
    """One row's comparison (``error`` is a one-line reason the row was not simulated)."""

    run: Run
    argv: tuple[str, ...]
    published: float | None = None
    predicted: float | None = None
    memory_gib: float | None = None
    error: str = ""

    @property
    def time_error(self) -> float | None:
        """predicted / published − 1 of tokens/s per GPU."""
        if self.published is None or self.predicted is None:
            return None
        return self.predicted / self.published - 1

    @property
    def published_memory_gib(self) -> float | None:
        """The published memory in GiB (the row's ``memory_gb`` is GB unless its note says GiB)."""
        value = self.run.float("memory_gb")
        if value is None:
            return None
        return value if "GiB" in self.run["memory_note"] else value * 1e9 / 2**30

    @property
    def memory_error(self) -> float | None:
        pub = self.published_memory_gib
        return None if pub is None or self.memory_gib is None else self.memory_gib / pub - 1

    @property
    def fitted(self) -> bool:
        return self.run.id in FIT_ROWS


def peak_for(run: Run) -> float | None:
    """The 16-bit dense peak of the row's GPU (for rows published as MFU)."""
    name = {"a100": "a100-80gb"}.get(run["gpu"], run["gpu"])
    acc = accelerator(name)
    for dtype in ("bf16", "fp16"):
        if dtype in acc.peak_flops:
            return acc.peak(dtype)
    return None


def predict(run: Run) -> Outcome:
    """Simulate ``run``'s spec as ``pipewright simulate`` does (module docstring)."""
    from pipewright.cli.simulate import simulated

    spec = published_spec(run.id)
    argv = (COMMAND, *spec_to_argv(spec, COMMAND))
    published = published_tokens_per_s(run, peak_for(run))
    if published is None:
        return Outcome(run, argv, error="the source gives no throughput for this run")
    if not run.int("global_batch_size"):
        return Outcome(run, argv, published, error="the source gives no global batch size")
    try:
        report = simulated(spec)
    except PipewrightError as exc:
        return Outcome(run, argv, published, error=str(exc))
    tokens = run.int("global_batch_size") * run.seq / report["iteration_time_s"] / run.gpus
    memory = max(r["peak_memory_bytes"] for r in report["per_rank"]) / 2**30
    return Outcome(run, argv, published, tokens, memory)


def summary(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Rows, median and largest |time error|, and the fraction within 10 % of those simulated."""
    errors = [abs(o.time_error) for o in outcomes if o.time_error is not None]
    if not errors:
        return {"rows": 0, "median": 0.0, "max": 0.0, "within_10": 0.0}
    return {
        "rows": len(errors),
        "median": statistics.median(errors),
        "max": max(errors),
        "within_10": sum(e <= 0.10 for e in errors) / len(errors),
    }
