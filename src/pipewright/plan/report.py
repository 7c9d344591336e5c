"""Run the planner with its baselines and render the result: plan JSON and a short summary."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipewright.mesh import DEFAULT_ORDER
from pipewright.plan.baselines import megatron_baseline, pipedream_baseline, uniform_baseline
from pipewright.plan.grouping import group_for
from pipewright.plan.mapping import device_order, placement
from pipewright.plan.partition import layout_string
from pipewright.plan.planfile import FORMAT, GRAD_REDUCE_PLANNED, framework_inputs, model_json
from pipewright.plan.search import Evaluated, Problem, SearchResult, _Context, search


def make_plan(
    prob: Problem, baselines: bool = True, progress: Callable[[int, int], None] | None = None
) -> SearchResult:
    """Search, then compute the baselines in the same run (their configurations also compete)."""
    ctx = _Context(prob, device_order(prob.topology))
    bases: list[Evaluated] = []
    dropped = []
    if baselines and prob.profile is None:  # (rules for analytical clusters: not from one profile)
        for name, fn in (("megatron", megatron_baseline), ("pipedream", pipedream_baseline)):
            ev = fn(ctx)
            if ev is not None:
                bases.append(ev)
            else:
                dropped.append(name)
    result = search(prob, progress=progress, baselines=bases)
    result.dropped_baselines = dropped
    if baselines:
        # the plan's degrees, else the first finalist's whose uniform layout fits
        for ev in result.finalists:
            uni = uniform_baseline(ctx, ev.candidate)
            if uni is not None and uni.fits:
                result.baselines.insert(0, uni)
                break
    return result


def _row(ev: Evaluated) -> dict[str, Any]:
    return {
        "config": ev.candidate.describe(),
        "layout": layout_string(ev.chunk_layers),
        "iteration_time_s": ev.time,
        "peak_memory_bytes": ev.simulated_memory,
        "fits": ev.fits,
    }


def plan_json(prob: Problem, result: SearchResult, schedule_csv: str | None = None) -> dict[str, Any]:
    """The plan file's contents (schema: :mod:`pipewright.plan.planfile`). ``schedule_csv``: the file,
    beside the plan, holding a generated order (zb-auto's)."""
    best = result.best
    c = best.candidate
    extra: dict[str, Any] = {}
    if best.schedule is not None:
        extra = {"schedule_csv": schedule_csv, "zb_memory_limit": best.zb_memory_limit}
    if best.recompute_per_stage is not None:
        extra["recompute_per_stage"] = list(best.recompute_per_stage)
    group = group_for(c.schedule, prob.microbatch_group)
    if group is not None:
        extra["microbatch_group"] = group
    return {
        "format": FORMAT,
        "version": 1,
        "model": model_json(prob.spec, prob.spec_for(c.tp).vocab),
        "topology": prob.topology.name,
        "devices": list(best.devices),
        "rank_order": DEFAULT_ORDER,
        "placement": list(placement(prob.topology, best.devices)),
        "tp": c.tp,
        "pp": c.pp,
        "dp": c.dp,
        "virtual": c.virtual,
        "schedule": c.schedule,
        "microbatch_size": c.microbatch,
        "microbatches": c.microbatches,
        "global_batch_size": prob.global_batch,
        "recompute": c.recompute,
        "sequence_parallel": c.sequence_parallel,
        "dtype": prob.dtype,
        "grad_reduce": GRAD_REDUCE_PLANNED,
        "attention": prob.attention,
        "cp": c.cp,
        **({"ep": c.ep} if c.ep > 1 else {}),
        "optimizer_sharding": c.sharding,
        "tp_comm_overlap": prob.tp_comm_overlap,
        "calibration": prob.calibration,
        **framework_inputs(
            [*prob.cost_fields, ("framework", prob.framework), ("attention_kernel", prob.attention_kernel)]
        ),
        "layout": layout_string(best.chunk_layers),
        **extra,
        "predicted": {"iteration_time_s": best.time, "peak_memory_bytes": best.simulated_memory},
        "baselines": [{"name": b.label, **_row(b)} for b in result.baselines],
        "runner_ups": [{**_row(ev), "why": ev.why} for ev in result.finalists[1:]],
        "search": {
            "candidates": result.considered,
            "pruned_by_bound": result.pruned,
            "do_not_fit": result.infeasible,
            "simulated": len(result.finalists) + len(result.baselines),
            "seconds": result.seconds,
        },
    }


def summary(prob: Problem, result: SearchResult) -> str:
    best = result.best
    gib = 2**30
    lines = [
        f"plan for {prob.spec.name} on {len(prob.topology.devices)} devices ({prob.topology.name}), "
        f"global batch {prob.global_batch}",
        f"  {best.candidate.describe()}",
        f"  layout {layout_string(best.chunk_layers)}",
        *(
            [f"  recomputation per stage {','.join(best.recompute_per_stage)}"]
            if best.recompute_per_stage is not None
            else []
        ),
        *(
            [f"  microbatch group {group} (Megatron's per virtual stage)"]
            if (group := group_for(best.candidate.schedule, prob.microbatch_group)) is not None
            else []
        ),
        f"  simulated iteration {best.time:.4f} s, peak memory {(best.simulated_memory or 0) / gib:.1f} GiB",
        f"  searched {result.considered} candidates ({result.pruned} pruned by the bound, "
        f"{result.infeasible} do not fit) in {result.seconds:.1f} s",
    ]
    if result.baselines:
        lines.append("baselines (simulated):")
        for b in result.baselines:
            verdict = _verdict(prob, best, b)
            lines.append(f"  {b.label:<10} {b.time:.4f} s  ({verdict})  " + b.candidate.describe())
    for name in result.dropped_baselines:
        lines.append(f"  {name:<10} left out: none of the layouts its rule gives fits the devices' memory")
    if len(result.finalists) > 1:
        lines.append("runner-ups:")
        shown: set[tuple[str, str]] = set()
        for ev in result.finalists[1:]:
            # a mapping style that changes nothing (the walk reversed on identical devices) is shown once
            key = (f"{ev.time:.6g}", ev.candidate.describe().rsplit(" map=", 1)[0])
            if key in shown or len(shown) == 5:
                continue
            shown.add(key)
            lines.append(f"  {ev.time:.4f} s  {ev.candidate.describe()}: {ev.why}")
    return "\n".join(lines)


def _verdict(prob: Problem, best: Evaluated, base: Evaluated) -> str:
    """How a baseline compares with the plan, in words; one that beats the plan names the option that
    kept the search from its configuration (--tp/--pp/--dp, --schedules, --recompute,
    --microbatch-sizes)."""
    if not base.fits:
        return "DOES NOT FIT in memory"
    if base.time >= best.time:
        return f"plan {base.time / best.time:.2f}x faster"
    c = base.candidate
    fixed = [
        f"--{name} {want}"
        for name, want, got in zip(("tp", "pp", "dp"), prob.fixed, (c.tp, c.pp, c.dp), strict=True)
        if want is not None and want != got
    ]
    if c.schedule not in prob.schedules:
        fixed.append(f"--schedules (has no {c.schedule})")
    if c.recompute not in prob.recompute:
        fixed.append(f"--recompute (has no {c.recompute})")
    if c.microbatch not in prob.microbatch_sizes:
        fixed.append(f"--microbatch-sizes (has no {c.microbatch})")
    why = f"outside {', '.join(fixed)}" if fixed else "the search missed it"
    return f"plan {best.time / base.time:.2f}x slower: {why}"
