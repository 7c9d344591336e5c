"""``pipewright simulate --fill kfac``: fill the simulated schedule's bubbles with K-FAC tasks (the
flags are declared by :class:`.options.KfacOptions`).

Task costs: ``--kfac-profile MODEL:GPU:BS`` takes the whole setup from PipeFisher's per-block profile
(one block per model chunk; F/B and K-FAC times as measured by the paper's authors); otherwise with
``--model`` the K-FAC tasks cost their FLOPs (:mod:`.cost`) at half the accelerator's fp32 peak, and
with ``--cost unit`` every K-FAC task of the one layer per chunk costs ``--kfac-unit`` (default 1).

Memory (a ``--model`` whose K-FAC memory is priced): each rank's memory by parts with a ``kfac`` part,
its peak with K-FAC and the fit check (:mod:`.simulate_memory`); exit status 1 when a rank does not
fit, unless ``--allow-no-fit``.
"""

from __future__ import annotations

import json
import sys

from pipewright.errors import ConfigError
from pipewright.features.kfac.cost import LinearShape, TaskTimes, block_layers


def _unit_times(stages: int, unit: float) -> TaskTimes:
    one = (LinearShape(1, 1),)
    return TaskTimes(
        (one,) * stages, (((unit, unit),),) * stages, (((unit, unit),),) * stages, (unit,) * stages
    )


def _model_times(request, setup) -> TaskTimes:
    from pipewright.hardware import accelerator

    model = setup.cost.spec
    stages = setup.schedule.num_stages
    if model.layers % stages:
        raise ConfigError(
            f"--fill kfac: {model.layers} layers do not split evenly over {stages} model chunks"
        )
    gpu = accelerator(request.gpu)
    rate = 0.5 * gpu.peak("fp32")
    tokens = (request.microbatch_size or 1) * model.seq_len
    shapes = [block_layers(model.hidden, model.ffn_hidden) * (model.layers // stages)] * stages
    return TaskTimes.from_flops(shapes, tokens, rate)


def run_fill(request, setup) -> int:
    """Fill, print the summary (or JSON) with K-FAC's memory, draw the refresh's timeline with
    ``--png`` (``request``: the :class:`~pipewright.plan.request.SimulateRequest`)."""
    from pipewright.features.kfac.fill import fill_kfac
    from pipewright.features.kfac.simulate_memory import memory_lines, memory_report, no_fit
    from pipewright.features.kfac.utilization import refresh_timeline

    opts = request.spec.features["kfac"]
    sched, cost, comm = setup.schedule, setup.cost, setup.comm
    label = setup.label
    profile = opts.profile
    if profile:
        from pipewright.cost.profiled import ProfiledCost
        from pipewright.features.kfac.cost import pipefisher_task_times

        try:
            model, gpu, bs = profile.split(":")
            bs = int(bs)
        except ValueError:
            raise ConfigError(
                f"--kfac-profile wants MODEL:GPU:BS, e.g. bert-large:v100:32 (got {profile!r})"
            ) from None
        cost = ProfiledCost.from_pipefisher(model, gpu, bs, layers=sched.num_stages)
        times = pipefisher_task_times(model, gpu, bs, sched.num_stages, layers=sched.num_stages)
        comm = None
        label = f"PipeFisher profile {model} on {gpu}, microbatch {bs}, one block per chunk"
    elif getattr(setup, "unit", False):
        times = _unit_times(sched.num_stages, opts.unit)
    else:
        times = _model_times(request, setup)
    res = fill_kfac(
        sched,
        cost,
        times,
        comm=comm,
        precondition=opts.precondition,
        split=not opts.no_split,
    )
    summary = res.summary()
    memory = None if profile else memory_report(setup)
    if memory is not None:
        summary.update(memory)
    if request.png:
        from pipewright.viz import draw_timeline

        title = f"{sched.name} + K-FAC ({res.refresh_interval} iterations of one refresh), {label}"
        draw_timeline(refresh_timeline(res), request.png, titles=[title])
    if request.json:
        print(json.dumps(summary, indent=2))
        return _fit_exit(request, memory, no_fit)
    print(f"{sched.name} + K-FAC, {label}")
    print(f"refresh interval          {res.refresh_interval} iterations (first refresh)")
    print(f"iterations per refresh    {res.steady_iterations_per_refresh:.3f} (refreshes back to back)")
    after = summary["iteration_time_after_mean"]
    print(f"iteration time            {res.iteration_time_before:.6g} → {after:.6g}")
    print(f"utilization               {res.utilization_before:.3f} → {res.utilization_after:.3f}")
    split = f"({res.split_inversions} inversions split)"
    print(f"refresh work in bubbles   {100 * res.fitted_fraction:.1f} %  {split}")
    if memory is not None:
        print("\n".join(memory_lines(memory)))
    if request.png:
        print(f"wrote {request.png}")
    return _fit_exit(request, memory, no_fit)


def _fit_exit(request, memory: dict | None, no_fit) -> int:
    """1 with a one-line error when a rank does not fit with K-FAC's memory (unless ``--allow-no-fit``)."""
    if memory is None or memory["memory"]["fits"] or request.spec.simulation.allow_no_fit:
        return 0
    print(f"pipewright: error: {no_fit(memory)}", file=sys.stderr)
    return 1


def simulate_hook(request, setup):
    """``pipewright simulate --fill kfac``: fill and report (an exit status); otherwise the setup."""
    if request.spec.features["kfac"].simulate_fill == "kfac":
        return run_fill(request, setup)
    return setup
