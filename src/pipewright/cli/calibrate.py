"""``pipewright calibrate --measured RUNS.csv --out CAL.json``: fit a framework's calibration on measured
runs and report how well it predicts and ranks the runs it was not fitted on.

The file's columns and the fixed split are :mod:`pipewright.cost.measured`'s; the fit and the file
written are :mod:`pipewright.cost.run_fit`'s; ``simulate``/``plan --calibration CAL.json`` read it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
from collections.abc import Callable, Sequence

from pipewright.cli.progress import Bar
from pipewright.cli.spec_args import add_command, required
from pipewright.cost.measured import MeasuredRun, simulate_argv
from pipewright.errors import ConfigError


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


def setup_flags(args: argparse.Namespace) -> list[str]:
    """The ``simulate`` flags every run shares (``calibrate``'s options)."""
    flags = ["--gpu", args.gpu, "--vocab", str(args.vocab), "--framework", args.framework]
    flags += ["--dtype", args.dtype, "--attention", args.attention, "--recompute", args.recompute]
    return [*flags, "--grad-reduce", args.grad_reduce]


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipewright.cost import frameworks
    from pipewright.cost.measured import load_runs, score, split
    from pipewright.cost.run_fit import Fitted, calibration_json, fit_runs, registered, write
    from pipewright.hardware import accelerator

    required("calibrate", **{"--measured": args.measured, "--gpu": args.gpu})  # the flags or --config
    accelerator(args.gpu)  # one line for an unknown GPU
    for flag, value in (("--vocab", args.vocab), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    predict = functools.partial(predict_all, per_node=args.gpus_per_node)
    fw = frameworks.framework(args.framework)
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise ConfigError(f"{args.out} exists; pass --overwrite to replace it")
    if not args.out and not args.no_fit:
        raise ConfigError("give --out FILE for the calibration (or --no-fit to score the registered one)")
    runs = load_runs(args.measured)
    fit_half, held = split(runs)
    setup = setup_flags(args)
    progress = not args.no_progress
    if args.no_fit:
        fitted = Fitted(fw.name, fw.dispatch, fw.compute, fw.host_per_kernel)
    else:
        fitted = fit_runs(fit_half, setup, fw.name, predict, Bar(progress, "fitting", "runs"))
    with registered(fitted):
        held_score = score(held, predict(held, setup, Bar(progress, "scoring", "runs")))
    report = {
        "measured": args.measured,
        "rows": len(runs),
        "fit_rows": len(fit_half),
        "held_out_rows": len(held),
        "framework": fitted.framework,
        "dispatch": fitted.dispatch,
        "compute": fitted.compute,
        "host_per_kernel": fitted.host_per_kernel,
        "held_out": held_score.as_dict(),
    }
    if args.out and not args.no_fit:
        write(
            args.out,
            calibration_json(fitted, args.gpu, args.measured, len(fit_half), held_score.as_dict()),
            True,
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.measured}: {len(runs)} runs; fitted on {len(fit_half)}, scored on the other {len(held)}")
    print(
        f"--framework {fitted.framework} (dispatch {fitted.dispatch}): compute c = {fitted.compute:.4f}, "
        f"host per kernel δ = {fitted.host_per_kernel * 1e6:.2f} µs"
    )
    print("held-out runs:")
    for line in held_score.lines():
        print(f"  {line}")
    if args.out and not args.no_fit:
        print(f"wrote {args.out} (simulate/plan --calibration {args.out})")
    return 0


def predict_seconds(argv: Sequence[str]) -> float:
    """The iteration time ``pipewright simulate argv`` reports (in-process); a one-line ConfigError
    with its message when the simulation fails."""
    from pipewright.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*argv, "--json"])
    if rc != 0:
        message = err.getvalue().strip().removeprefix("pipewright: error: ")
        raise ConfigError(f"simulate {' '.join(argv[1:])}: {message}")
    return float(json.loads(out.getvalue())["iteration_time_s"])


def predict_all(
    runs: Sequence[MeasuredRun],
    setup: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
    per_node: int = 8,
) -> list[float]:
    """Predicted seconds of every run under ``setup`` on machines of ``per_node`` GPUs
    (:func:`simulate_argv`)."""
    out = []
    for i, run in enumerate(runs):
        try:
            out.append(predict_seconds(simulate_argv(run, setup, per_node)))
        except ConfigError as exc:
            raise ConfigError(f"line {run.line}: {exc}") from None
        if progress is not None:
            progress(i + 1, len(runs))
    return out
