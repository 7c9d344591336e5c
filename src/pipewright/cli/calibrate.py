"""``pipewright calibrate --measured RUNS.csv --out CAL.json``: fit a framework's calibration on measured
runs and report how well it predicts and ranks the runs it was not fitted on.

The file's columns and the fixed split are :mod:`pipewright.cost.measured`'s; the fit and the file
written are :mod:`pipewright.cost.run_fit`'s; ``simulate``/``plan --calibration CAL.json`` read it.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pipewright.cli.progress import Bar
from pipewright.cli.spec_args import add_command, required
from pipewright.cost.measured import MeasuredRun, run_values
from pipewright.errors import ConfigError, PipewrightError

if TYPE_CHECKING:
    from pipewright.runspec import RunSpec

#: RunSpec values by path (what every run shares: :func:`setup_values`)
Values = Mapping[tuple[str, ...], object]


def register(sub: argparse._SubParsersAction) -> None:
    add_command(
        sub,
        "calibrate",
        run,
        help="fit a framework's calibration on measured runs; report held-out error and ranking",
        description="Fit a framework's calibration on measured runs and report how well it predicts and "
        "ranks the runs it was not fitted on (docs/cost-model.md, 'Calibrating a framework on your "
        "measured runs').",
    )


def setup_values(spec: RunSpec) -> dict[tuple[str, ...], object]:
    """What every run's ``simulate`` spec shares: ``calibrate``'s GPU, vocabulary, framework, dtype,
    attention, recomputation and gradient reduction."""
    return {
        ("cluster", "gpu"): spec.cluster.gpu,
        ("model", "vocab"): spec.model.vocab,
        ("framework", "name"): spec.framework.name,
        ("precision", "dtype"): spec.precision.dtype,
        ("framework", "attention"): spec.framework.attention,
        ("memory", "recompute"): spec.memory.recompute,
        ("framework", "grad_reduce"): spec.framework.grad_reduce,
    }


def flag_setup(flags: Sequence[str]) -> dict[tuple[str, ...], object]:
    """:func:`setup_values` of ``calibrate``'s ``flags`` (``["--gpu", "a100-80gb", …]``), parsed by the
    command's own parser."""
    return setup_values(_own_parser().parse_args(["calibrate", *flags]).spec)


@functools.cache
def _own_parser() -> argparse.ArgumentParser:
    """A parser holding ``calibrate`` alone (:func:`register`)."""
    parser = argparse.ArgumentParser(prog="pipewright")
    register(parser.add_subparsers(dest="command"))
    return parser


def run(args: argparse.Namespace) -> int:
    from pipewright.cost import frameworks
    from pipewright.cost.measured import load_runs, score, split
    from pipewright.cost.run_fit import Fitted, calibration_file, fit_runs, fit_shapes, registered

    spec = args.spec
    measured, gpu, out = spec.calibrating.measured, spec.cluster.gpu, spec.output.out
    _check(spec)
    per_node = spec.cluster.gpus_per_node
    predict = functools.partial(predict_all, per_node=per_node)
    fw = frameworks.framework(spec.framework.name)
    runs = load_runs(measured)
    fit_half, held = split(runs)
    setup = setup_values(spec)
    progress, no_fit = spec.output.progress, spec.calibrating.no_fit
    shapes: dict = {}
    if no_fit:
        fitted = Fitted(fw.name, fw.dispatch, fw.compute, fw.host_per_kernel)
    else:
        fitted = fit_runs(fit_half, setup, fw.name, predict, Bar(progress, "fitting", "runs"))
        shape = functools.partial(run_shape, setup=setup, per_node=per_node)
        shapes = fit_shapes(fit_half, setup, fitted, gpu, predict, shape, Bar(progress, "shapes", "runs"))
    with registered(fitted):
        alone = score(held, predict(held, setup, Bar(progress, "scoring", "runs")))
    held_score, unseen = alone, held
    if shapes:
        with calibration_file(fitted, gpu, shapes) as path:
            with_shapes = {**setup, ("cluster", "calibration"): path}
            predicted = predict(held, with_shapes, Bar(progress, "scoring", "runs"))
        held_score = score(held, predicted)
        unseen_rows = [i for i, r in enumerate(held) if run_shape(r, setup, per_node) not in shapes]
        unseen = tuple(held[i] for i in unseen_rows)
        unseen_mape = score(unseen, [predicted[i] for i in unseen_rows]).mape if unseen else 0.0
    report = {
        "measured": measured,
        "rows": len(runs),
        "fit_rows": len(fit_half),
        "held_out_rows": len(held),
        "framework": fitted.framework,
        "dispatch": fitted.dispatch,
        "compute": fitted.compute,
        "host_per_kernel": fitted.host_per_kernel,
        "shapes": len(shapes),
        "held_out": held_score.as_dict(),
        "held_out_mechanisms": alone.as_dict(),
    }
    if shapes:
        report["held_out_unseen_shapes"] = {"rows": len(unseen), "mape": unseen_mape}
    if out and not no_fit:
        from pipewright.cost.run_fit import calibration_json, write

        data = calibration_json(fitted, gpu, shapes, measured, len(fit_half), held_score.as_dict())
        write(out, data, True)
    if spec.output.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{measured}: {len(runs)} runs; fitted on {len(fit_half)}, scored on the other {len(held)}")
    print(
        f"--framework {fitted.framework} (dispatch {fitted.dispatch}): compute c = {fitted.compute:.4f}, "
        f"host per kernel δ = {fitted.host_per_kernel * 1e6:.2f} µs"
    )
    if shapes:
        print(f"measured shapes: {len(shapes)} (layers × {_span(s.layers for s in shapes.values())}, "
              f"embedding and head × {_span(s.ends for s in shapes.values())})")  # fmt: skip
        print("held-out runs, with the measured shapes:")
        for line in held_score.lines():
            print(f"  {line}")
        print(f"  of them {len(unseen)} of shapes not fitted on: MAPE {unseen_mape:.1%}")
    print("held-out runs, by the mechanisms alone (c, δ):" if shapes else "held-out runs:")
    for line in alone.lines():
        print(f"  {line}")
    if out and not no_fit:
        print(f"wrote {out} (simulate/plan --calibration {out})")
    return 0


def _span(values) -> str:
    """ "lo–hi" of ``values``."""
    values = list(values)
    return f"{min(values):.2f}–{max(values):.2f}"


def run_shape(run: MeasuredRun, setup: Values, per_node: int = 8):
    """The :class:`~pipewright.cost.shape_scales.Shape` ``simulate`` prices ``run`` with under ``setup``."""
    from pipewright.cli.simulate import priced_cost
    from pipewright.cost.shape_scales import shape_of
    from pipewright.runspec import defaults, with_values

    return shape_of(priced_cost(with_values(defaults("simulate"), {**run_values(run, per_node), **setup})))


def _check(spec: RunSpec) -> None:
    """One line for a missing input, an unknown GPU, a count below one, an output that exists."""
    from pathlib import Path

    from pipewright.hardware import accelerator

    out = spec.output.out
    required("calibrate", **{"--measured": spec.calibrating.measured, "--gpu": spec.cluster.gpu})
    accelerator(spec.cluster.gpu)  # one line for an unknown GPU
    for flag, value in (("--vocab", spec.model.vocab), ("--gpus-per-node", spec.cluster.gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if out and Path(out).exists() and not spec.output.overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    if not out and not spec.calibrating.no_fit:
        raise ConfigError("give --out FILE for the calibration (or --no-fit to score the registered one)")


def predict_seconds(spec: RunSpec) -> float:
    """The iteration time ``pipewright simulate`` reports for ``spec`` (in-process,
    :func:`pipewright.cli.simulate.simulated`); a one-line ConfigError naming the run's flags and the
    reason when the simulation fails."""
    from pipewright.cli.simulate import simulated
    from pipewright.runspec import spec_to_argv

    try:
        return float(simulated(spec)["iteration_time_s"])
    except PipewrightError as exc:
        raise ConfigError(f"simulate {' '.join(spec_to_argv(spec, 'simulate'))}: {exc}") from None


def predict_all(
    runs: Sequence[MeasuredRun],
    setup: Values,
    progress: Callable[[int, int], None] | None = None,
    per_node: int = 8,
) -> list[float]:
    """Predicted seconds of every run with the spec values ``setup`` (:func:`setup_values`) on machines
    of ``per_node`` GPUs (:func:`pipewright.cost.measured.run_values`)."""
    from pipewright.runspec import defaults, with_values

    start = defaults("simulate")
    out = []
    for i, run in enumerate(runs):
        try:
            out.append(predict_seconds(with_values(start, {**run_values(run, per_node), **setup})))
        except ConfigError as exc:
            raise ConfigError(f"line {run.line}: {exc}") from None
        if progress is not None:
            progress(i + 1, len(runs))
    return out
