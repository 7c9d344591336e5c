"""``pipewright train --compare-sim``: the simulator's prediction of a training run next to its measurement.

Before training, :func:`plan_comparison` gets a profile of the run's model — the ``--profile`` file
(checked to belong to the same model dimensions and to hold the run's microbatch size) or, without one,
a fresh in-process :func:`~pipewright.runtime.profiling.profiler.profile_model` of the model with as many
measuring workers as the run has processes (at most one per core). After training,
:func:`bracket_profile` profiles an in-process plan again and predicts from the mean of both profiles
(``profile-before.csv``, ``profile-after.csv`` and the merged ``profile.csv`` in the run folder), and
:func:`compare_run`:

- **predicted** step time = the simulated iteration time of the run's schedule (the setup
  :func:`pipewright.plan.setup.profile_setup` builds, as ``pipewright simulate --profile`` does:
  :class:`~pipewright.cost.ProfiledCost` and :class:`~pipewright.cost.profiled.ProfiledComm`, the
  profiled boundary-message time for p2p, ``topology.single_host`` for data-parallel all-reduces)
  + the optimizer step: max over pipeline ranks of the ``STEP`` times of the layers the rank holds
  (the trainer steps after the pipeline flush, all ranks together);
- **measured** step time = the median ``step_time_s`` of ``metrics.jsonl`` over the steps after the
  first third (warm-up); bubble fraction likewise (the executor's timeline of each step);
- per compute kind, measured / profiled total time in the last step (``compute_ratio``: how much slower
  the actions ran in the run than when profiled — machine load, contention);
- **replay**: the schedule simulated again with each stage's mean measured duration per compute kind
  from the last step (:class:`ReplayCost`), against that step's executor time — the simulator's
  execution rules (dependencies, order, messages) checked with compute-speed differences taken out;
- writes ``compare.json`` and ``compare.png`` (the measured timeline of the last step above the
  predicted one, same time axis).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipewright.cost.profiled import (
    ProfiledComm,
    ProfiledCost,
    ProfileRow,
    load_profile,
    mean_profile,
    write_profile_csv,
)
from pipewright.errors import ConfigError
from pipewright.ir import STEP, Schedule
from pipewright.models.spec import ModelSpec
from pipewright.plan.setup import core_sharing, profile_setup
from pipewright.runtime.setup.config import TrainConfig
from pipewright.sim.engine import SimResult, simulate
from pipewright.sim.sharing import SharedCompute, makespan_together
from pipewright.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComparePlan:
    """The run's config and model with the profile to predict it from (``source``: the file, or None
    when it was measured in-process)."""

    config: TrainConfig
    spec: ModelSpec
    rows: tuple[ProfileRow, ...]
    meta: dict[str, str] = field(default_factory=dict)
    source: str | None = None
    #: the profiles merged into ``rows`` by :func:`bracket_profile` (before and after the run), else ()
    brackets: tuple[tuple[tuple[ProfileRow, ...], dict[str, str]], ...] = ()
    #: the run's compute-only schedule (None: the config's, from the schedule library's core families)
    schedule: Schedule | None = None


def plan_comparison(
    config: TrainConfig,
    profile: str | None = None,
    *,
    progress: bool = True,
    schedule: Schedule | None = None,
) -> ComparePlan:
    """Resolve the model and get its profile (see the module docstring); all checks happen here, before
    any training."""
    from pipewright.data import open_dataset
    from pipewright.runtime.profiling.profiler import check_profile_matches

    vocab = None
    if not config.vocab:
        vocab = open_dataset(config.data, tokenizer=config.tokenizer, progress=False).vocab_size
    spec = config.model_spec(vocab)
    if profile is not None:
        rows, meta = load_profile(profile)
        check_profile_matches(meta, spec, config.tp, profile)
    else:
        rows, meta = _profile_in_process(config, spec, progress)
    ProfiledCost(tuple(rows), config.microbatch_size, spec.layers)  # the microbatch size must be there
    return ComparePlan(config, spec, tuple(rows), meta, profile, schedule=schedule)


def _profile_in_process(
    config: TrainConfig, spec: ModelSpec, progress: bool
) -> tuple[tuple[ProfileRow, ...], dict[str, str]]:
    """Profile the run's model at its microbatch size on the run's device (CUDA where the workers
    train on it: NCCL, CUDA tensors in the run's precision; else the CPU, with its workers'
    contention)."""
    import torch

    from pipewright.runtime.profiling.profiler import ProfileOptions, profile_model

    cuda = torch.cuda.is_available()  # the trainer's device (runtime/parallel/process_mesh.py default_device)
    options = ProfileOptions(
        spec,
        (config.microbatch_size,),
        tp=config.tp,
        device="cuda" if cuda else "cpu",
        progress=progress,
        workers=config.tp if cuda else profile_workers(config),
        contention=0 if cuda or config.world_size < 2 else config.world_size,
        cpu_allocator=config.cpu_allocator,
        precision=config.precision,
    )
    rows, raw = profile_model(options)
    return tuple(rows), {k: str(v) for k, v in raw.items()}


def bracket_profile(plan: ComparePlan, *, progress: bool = True) -> ComparePlan:
    """After the run: profile again and predict from the mean of the two profiles
    (:func:`~pipewright.cost.profiled.mean_profile`). On a shared machine outside load comes and goes
    for seconds at a time; a profile taken right before the run catches one moment of it, two
    bracketing the run average over its span (as the median step does) and their disagreement shows
    how much the machine drifted meanwhile (``compare.json``: ``profile_drift``). A plan from a
    ``--profile`` file is returned unchanged."""
    if plan.source is not None:
        return plan
    return with_brackets(plan, (plan.rows, plan.meta), _profile_in_process(plan.config, plan.spec, progress))


def with_brackets(
    plan: ComparePlan,
    before: tuple[tuple[ProfileRow, ...], dict[str, str]],
    after: tuple[tuple[ProfileRow, ...], dict[str, str]],
) -> ComparePlan:
    """``plan`` predicting from the mean of the profiles ``before`` and ``after`` a run."""
    rows, meta = mean_profile([before, after])
    return replace(plan, rows=rows, meta=meta, brackets=(before, after), source=None)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_sharing(
    config: TrainConfig, meta: dict[str, str] | None = None, cores: int | None = None
) -> SharedCompute | None:
    """How the run's processes share compute (:mod:`pipewright.sim.sharing`). On CPU (no CUDA) the
    ``world_size`` single-threaded workers share this host's ``cores``, and each simulated pipeline rank
    stands for ``tp · dp`` of them. With the profile's measured contention curve (header
    ``contention=``, relative to its ``workers`` busy processes, under which its times were taken),
    that curve; else, when there are more workers than cores, ideal sharing. None on GPUs, or when
    every process has a core and no curve was measured."""
    import torch

    if torch.cuda.is_available():
        return None
    cores = usable_cores() if cores is None else cores
    meta = meta or {}
    if not meta.get("contention") and config.world_size <= cores:
        return None
    return core_sharing(config.pp, cores, meta, processes_per_rank=config.tp * config.dp)


def profile_workers(config: TrainConfig, cores: int | None = None) -> int:
    """Processes that measure at once when profiling for this run: the run's process count, but at most
    one per core (in multiples of tp) — on an oversubscribed host the profile gives dedicated-core
    times and the simulator's processor sharing (:func:`host_sharing`) adds the time slicing."""
    cores = usable_cores() if cores is None else cores
    return max(config.tp, min(config.world_size, cores) // config.tp * config.tp)


def optimizer_time(cost: ProfiledCost, schedule: Schedule, shared: SharedCompute | None = None) -> float:
    """max over pipeline ranks of Σ over the rank's chunks and their layers of the profiled STEP time;
    with ``shared`` units, every rank's step runs at once on them (:func:`makespan_together`)."""
    per_rank = [
        sum(
            count * cost.time(lt, STEP)
            for stage in schedule.stages_of(rank)
            for lt, count in cost.composition(stage, schedule).items()
        )
        for rank in range(schedule.num_ranks)
    ]
    if shared is None:
        return max(per_rank)
    return makespan_together(per_rank, shared)


def predict(plan: ComparePlan) -> tuple[SimResult, ProfiledCost, float, ProfiledComm]:
    """The simulation of the run's schedule, its cost and comm models and the predicted optimizer-step
    time."""
    from pipewright.runtime.core.schedule_source import resolve_schedule

    c = plan.config
    shared = host_sharing(c, plan.meta)
    setup = profile_setup(
        plan.rows,
        plan.meta,
        plan.schedule if plan.schedule is not None else resolve_schedule(c),
        c.microbatch_size,
        plan.spec.layers,
        tp=c.tp,
        dp=c.dp,
        layout=c.layout or None,
        shared=shared,
    )
    assert isinstance(setup.cost, ProfiledCost) and isinstance(setup.comm, ProfiledComm)
    sim = setup.simulate()
    return sim, setup.cost, optimizer_time(setup.cost, setup.schedule, shared), setup.comm


def profile_drift(
    before: tuple[tuple[ProfileRow, ...], dict[str, str]],
    after: tuple[tuple[ProfileRow, ...], dict[str, str]],
) -> dict[str, float]:
    """Per kind of the transformer layer: its time in the profile after the run over the one before
    (1.0: the machine ran at the same speed at both ends of the run); with contention curves, also
    ``contention``: the slowdown with every process busy, s(N) relative to the profile's ``workers``,
    after over before."""

    def times(rows: tuple[ProfileRow, ...]) -> dict[str, float]:
        return {r.kind: r.seconds for r in rows if r.layer_type == "layer" and r.seconds > 0}

    t0, t1 = times(before[0]), times(after[0])
    drift = {k: t1[k] / t0[k] for k in sorted(t0) if k in t1}
    s0, s1 = _full_load_slowdown(before[1]), _full_load_slowdown(after[1])
    if s0 and s1:
        drift["contention"] = s1 / s0
    return drift


def _full_load_slowdown(meta: dict[str, str]) -> float | None:
    """s(N) relative to the profile's ``workers``, as the simulator reads the curve (None without one)."""
    if not meta.get("contention"):
        return None
    return SharedCompute.from_profile(1, 1, meta).slowdown[-1]


def measured_steps(metrics_path: Path) -> tuple[list[dict[str, Any]], int]:
    """The step records after warm-up (the first third of the steps, at least one when there are two
    or more) and the number of warm-up steps skipped."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not records:
        raise ConfigError(f"{metrics_path} has no steps to compare")
    skip = max(1, len(records) // 3) if len(records) > 1 else 0
    return records[skip:], skip


@dataclass(frozen=True, eq=False)
class ReplayCost:
    """A CostModel that gives each (stage, kind) of compute action its mean duration in a measured
    timeline (the last step; the simulator costs every microbatch of a stage alike), everything else
    from ``base``: simulating with it checks the simulator's execution rules (dependencies, order,
    messages) against the runtime with the compute-speed difference from the profile taken out."""

    base: ProfiledCost
    durations: dict

    @classmethod
    def from_timeline(cls, base: ProfiledCost, measured: Timeline) -> ReplayCost:
        spans: dict[tuple[int, str], list[float]] = {}
        for s in measured.spans:
            if s.stream == "compute":
                spans.setdefault((s.action.stage, s.action.kind), []).append(s.duration)
        return cls(base, {key: statistics.fmean(v) for key, v in spans.items()})

    def compute_time(self, action, schedule: Schedule) -> float:
        hit = self.durations.get((action.stage, action.kind))
        return hit if hit is not None else self.base.compute_time(action, schedule)

    def message_bytes(self, action, schedule: Schedule) -> float:
        return self.base.message_bytes(action, schedule)

    def activation_bytes(self, action, schedule: Schedule) -> float:
        return self.base.activation_bytes(action, schedule)

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return self.base.static_bytes(rank, schedule)

    def flops(self, action, schedule: Schedule) -> float:
        return 0.0

    def model_flops(self, action, schedule: Schedule) -> float:
        return 0.0


def kind_ratios(measured: Timeline, predicted: Timeline) -> dict[str, float]:
    """Per compute kind: total measured span time / total predicted span time (the last measured step
    against the simulated one) — which actions took longer in the run than in the profile."""
    totals: dict[str, list[float]] = {}
    for which, tl in enumerate((measured, predicted)):
        for span in tl.spans:
            if span.stream == "compute":
                totals.setdefault(span.action.kind, [0.0, 0.0])[which] += span.duration
    return {kind: m / p for kind, (m, p) in sorted(totals.items()) if p > 0}


def compare_run(plan: ComparePlan, out_dir: str | Path) -> dict[str, Any]:
    """Predict, read the measurement of the finished run in ``out_dir``, write ``compare.json`` and
    ``compare.png`` there (and ``profile.csv`` when profiled in-process; ``profile-before.csv`` and
    ``profile-after.csv`` too after :func:`bracket_profile`). Returns the report."""
    from pipewright.viz.timeline_figure import draw_timeline

    out_dir = Path(out_dir)
    c = plan.config
    sim, cost, opt_s, comm = predict(plan)
    steps, skipped = measured_steps(out_dir / "metrics.jsonl")
    measured_step = statistics.median(r["step_time_s"] for r in steps)
    bubbles = [r["bubble_fraction"] for r in steps if r.get("bubble_fraction") is not None]
    predicted_step = sim.iteration_time + opt_s
    report: dict[str, Any] = {
        "schedule": sim.schedule.name,
        "pp": c.pp,
        "dp": c.dp,
        "tp": c.tp,
        "stages": sim.schedule.num_stages,
        "microbatches": c.microbatches,
        "microbatch_size": c.microbatch_size,
        "model": plan.spec.name,
        "profile": plan.source or str(out_dir / "profile.csv"),
        "measured": {
            "step_time_s": measured_step,
            "bubble_fraction": statistics.median(bubbles) if bubbles else None,
            "steps": [r["step"] for r in steps],
            "warmup_steps_skipped": skipped,
        },
        "predicted": {
            "step_time_s": predicted_step,
            "pipeline_time_s": sim.iteration_time,
            "optimizer_time_s": opt_s,
            "bubble_fraction": sim.bubble_fraction,
            "core_sharing": None if (shared := host_sharing(c, plan.meta)) is None else list(shared.units),
        },
        "ratio": measured_step / predicted_step if predicted_step > 0 else None,
    }
    if plan.source is None:
        (out_dir / "profile.csv").write_text(write_profile_csv(plan.rows, plan.meta))
    if plan.brackets:
        by_profile = {}
        for name, (rows, meta) in zip(("before", "after"), plan.brackets, strict=False):
            (out_dir / f"profile-{name}.csv").write_text(write_profile_csv(rows, meta))
            one, _, one_opt, _ = predict(replace(plan, rows=rows, meta=meta, brackets=()))
            by_profile[name] = one.iteration_time + one_opt
        report["predicted"]["by_profile"] = by_profile
        report["profile_drift"] = profile_drift(*plan.brackets)
    timeline_path = out_dir / "timeline.json"
    if timeline_path.is_file():
        measured = Timeline.from_json(json.loads(timeline_path.read_text()))
        report["measured"]["pipeline_time_s"] = measured.makespan
        report["compute_ratio"] = kind_ratios(measured, sim.timeline)
        replay = simulate(sim.schedule, ReplayCost.from_timeline(cost, measured), comm=comm)
        report["replay"] = {
            "pipeline_time_s": replay.iteration_time,
            "bubble_fraction": replay.bubble_fraction,
            "ratio": measured.makespan / replay.iteration_time if replay.iteration_time > 0 else None,
        }
        name = (
            f"{sim.schedule.name}, tp={c.tp} cp={c.cp} pp={c.pp} dp={c.dp} stages={sim.schedule.num_stages}, "
            f"m={c.microbatches}"
        )
        draw_timeline(
            [measured, sim.timeline],
            out_dir / "compare.png",
            titles=[
                f"measured: {name}, last step (executor {measured.makespan * 1e3:.1f} ms)",
                f"predicted from the profile: {sim.iteration_time * 1e3:.1f} ms",
            ],
        )
        report["png"] = str(out_dir / "compare.png")
    else:
        log.warning("no measured timeline in %s (--no-artifacts?): compare.png not drawn", out_dir)
    (out_dir / "compare.json").write_text(json.dumps(report, indent=1))
    return report


#: |after/before − 1| of a bracketed run's profiles beyond which :func:`summary` warns.
DRIFT_WARNING = 0.10


def unsteady(report: dict[str, Any]) -> bool:
    """Did the layer's forward or backward time, or the slowdown with every process busy, move by more
    than ``DRIFT_WARNING`` between the profiles taken before and after the run?"""
    drift = report.get("profile_drift", {})
    return any(abs(drift[k] - 1.0) > DRIFT_WARNING for k in ("F", "B", "contention") if k in drift)


def _drift_text(report: dict[str, Any]) -> str:
    names = {"F": "layer forward", "B": "layer backward", "contention": "slowdown with all processes busy"}
    drift = report.get("profile_drift", {})
    return ", ".join(f"{name} {drift[k]:.2f}x" for k, name in names.items() if k in drift)


def summary(report: dict[str, Any]) -> str:
    """Printable lines: measured vs predicted step time and bubble fraction, then whichever of core
    sharing, the bracketing profiles (with a warning when the machine drifted), the per-kind compute
    ratios and the replay the report holds."""
    m, p = report["measured"], report["predicted"]
    bubble = "n/a" if m["bubble_fraction"] is None else f"{m['bubble_fraction']:.3f}"
    lines = [
        f"step time: measured {m['step_time_s'] * 1e3:.1f} ms (median of {len(m['steps'])} steps), "
        f"predicted {p['step_time_s'] * 1e3:.1f} ms (pipeline {p['pipeline_time_s'] * 1e3:.1f} + optimizer "
        f"{p['optimizer_time_s'] * 1e3:.1f}); measured/predicted {report['ratio']:.3f}",
        f"bubble fraction: measured {bubble}, predicted {p['bubble_fraction']:.3f}",
    ]
    if p.get("core_sharing"):
        lines.append(
            f"predicted with the {report['pp'] * report['dp'] * report['tp']} processes sharing "
            f"{p['core_sharing'][0]:g} CPU cores"
        )
    if by := p.get("by_profile"):
        lines.append(
            f"profiled before and after the run (predicted {by['before'] * 1e3:.1f} and "
            f"{by['after'] * 1e3:.1f} ms from each alone; after/before: {_drift_text(report)}); "
            "predicted from their mean"
        )
        if unsteady(report):
            lines.append(
                f"warning: the machine's speed changed by more than {DRIFT_WARNING:.0%} during the run "
                "(other load?); measured/predicted says as much about the machine as about the model"
            )
    for kind, ratio in report.get("compute_ratio", {}).items():
        lines.append(f"{kind} actions took {ratio:.2f}x their profiled time")
    if "replay" in report:
        lines.append(
            f"replay (simulated with each stage's mean action times of the last step): executor "
            f"{m['pipeline_time_s'] * 1e3:.1f} ms, simulated "
            f"{report['replay']['pipeline_time_s'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)
