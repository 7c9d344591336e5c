"""The PipeFisher utilization analysis from the shared profiles (pure Python).

For BERT-Large on V100 (or any profiled model), microbatch B, one block per stage and D = p
microbatches, fill GPipe, 1F1B and a zero-bubble schedule with one K-FAC refresh and compare the
steady-state iterations per refresh with the paper's performance model

    iterations per refresh = (D·T_kron + T_inv) / ((D − 1)·(T_f + T_b))       (PipeFisher, §3)

The model counts the whole bubble of a stage as usable; the pass packs discrete tasks (with the 1.05
margin) and respects dependencies, so it can only need as many iterations or more.

Two definitions of "iterations per refresh" sit side by side: pipewright's steady state (refreshes back
to back, fractional, and the first refresh alone) and PipeFisher's own, the period of its automatic plan
(:mod:`pipewright.features.kfac.pipefisher_plan`, an integer: the plan repeats every that many
iterations, and a task that fits no bubble runs after the plan's last iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.profiled import ProfiledCost
from pipewright.features.kfac.cost import pipefisher_task_times
from pipewright.features.kfac.fill import FillResult, fill_kfac
from pipewright.schedules.registry import build_schedule, info
from pipewright.sim.engine import simulate
from pipewright.timeline import Span, Timeline


@dataclass(frozen=True)
class Row:
    schedule: str
    stages: int
    model: float | None  # the paper's iterations per refresh (GPipe/1F1B only)
    result: FillResult

    @property
    def deviation(self) -> float | None:
        if self.model is None:
            return None
        return self.result.steady_iterations_per_refresh / self.model - 1


def paper_model(model: str, gpu: str, bs: int, stages: int) -> float:
    """(D·T_kron + T_inv) / ((D − 1)(T_f + T_b)) with D = stages, from the profile."""
    prof = ProfiledCost.from_pipefisher(model, gpu, bs, layers=stages)
    tf, tb = prof.time("layer", "F"), prof.time("layer", "B")
    kron, inv = prof.time("layer", "KFAC_KRON"), prof.time("layer", "KFAC_INV")
    return (stages * kron + inv) / ((stages - 1) * (tf + tb))


def fill_profiled(
    name: str, model: str, gpu: str, bs: int, stages: int, *, precondition: str = "end", split: bool = True
) -> FillResult:
    """Fill ``name`` over ``stages`` ranks (one block per model chunk, D = stages microbatches)."""
    virtual = info(name).default_chunks
    chunks = stages * virtual
    cost = ProfiledCost.from_pipefisher(model, gpu, bs, layers=chunks)
    times = pipefisher_task_times(model, gpu, bs, chunks, layers=chunks)
    sched = build_schedule(name, stages, stages, virtual)
    return fill_kfac(sched, cost, times, precondition=precondition, split=split)


def utilization_table(
    model: str = "bert-large",
    gpu: str = "v100",
    bs: int = 32,
    stages: tuple[int, ...] = (4, 8, 16),
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
    extra: tuple[tuple[str, int], ...] = (("zb-h1", 4), ("zb-h1", 8)),
    precondition: str = "end",
) -> list[Row]:
    rows = []
    for d in stages:
        for name in schedules:
            res = fill_profiled(name, model, gpu, bs, d, precondition=precondition)
            rows.append(Row(name, d, paper_model(model, gpu, bs, d), res))
    for name, d in extra:
        rows.append(Row(name, d, None, fill_profiled(name, model, gpu, bs, d, precondition=precondition)))
    return rows


def markdown(rows: list[Row], reference: dict[tuple[str, int], int] | None = None) -> str:
    """The table of docs/pipefisher.md; ``reference`` maps (schedule, D) to the plan period PipeFisher's
    own ``auto_schedule.py`` gives on the same simulated timeline (``tools/pipefisher_reference.py``)."""
    reference = reference or {}
    head = (
        "| schedule | D | paper model | iterations per refresh (steady) | refresh interval (first) | "
        "PipeFisher's plan period | PipeFisher's auto_schedule.py | deviation | utilization before | "
        "after | refresh work in bubbles | step time ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        res = r.result
        model = f"{r.model:.2f}" if r.model is not None else "–"
        dev = f"{r.deviation * 100:+.1f} %" if r.deviation is not None else "–"
        theirs = reference.get((r.schedule, r.stages), "–")
        lines.append(
            f"| {r.schedule} | {r.stages} | {model} | {res.steady_iterations_per_refresh:.2f} | "
            f"{res.refresh_interval} | {res.pipefisher_plan_iterations} | {theirs} | {dev} | "
            f"{res.utilization_before * 100:.1f} % | "
            f"{res.utilization_after * 100:.1f} % | {res.fitted_fraction * 100:.0f} % | "
            f"{res.step_time_ratio:.3f} |"
        )
    return "\n".join(lines)


def refresh_timeline(result: FillResult) -> Timeline:
    """The iterations of one refresh, simulated one after another, as one timeline (seconds)."""
    spans: list[Span] = []
    t0 = 0.0
    for it, sched in enumerate(result.iterations):
        sim = simulate(sched, result.cost, comm=result.comm)
        for s in sim.timeline.spans:
            spans.append(Span(s.rank, s.action, s.start + t0, s.end + t0, s.stream, it))
        t0 += sim.iteration_time
    meta = {"schedule": result.base.name + " + K-FAC", "iterations": len(result.iterations)}
    return Timeline.of(result.base.num_ranks, spans, source="simulated", meta=meta)
