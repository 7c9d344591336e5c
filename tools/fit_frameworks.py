"""Least-squares fit of each training framework's calibration (pipewright.cost.frameworks) on its rows.

    PYTHONPATH=src python tools/fit_frameworks.py                  # every framework with rows
    PYTHONPATH=src python tools/fit_frameworks.py --only torchtitan
    PYTHONPATH=src python tools/fit_frameworks.py --complement    # fit on the other rows instead (a check)

For framework f, the fit rows are ``pipewright.cost.fidelity.framework_fit_selection`` (a fixed rule:
within each source sorted by id, every second row, rows with a known mispriced mechanism left out). The
parameters are x = (u, τ_f) with the compute factor c = 1 / (1 + u) (so u is the extra GEMM time per
unit of Megatron GEMM time) and τ_f the added seconds per layer and forward. Each row's relative time
error is r_i(x) = T_i(x) / P_i − 1 (T the simulated iteration time, P the published one: the published
tokens/s per GPU converted back); the fit minimises Σ r_i(x)² by Gauss–Newton: T_i is linearised by
finite differences (Δu = 0.1, Δτ = 0.1 ms), the linear least-squares step solved, three iterations
(each row's time is piecewise linear in u and τ: every action's cost is). τ_f is fitted only with at
least three fit rows (else 0) and clamped at 0 (a negative overhead is refitted as 0). Each row runs
through ``pipewright simulate`` in-process, the candidate registered under the framework's name.
Prints c, τ_f, each fit row's error before and after, and the registry lines.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from pipewright.cli.fidelity_predictions import peak_for, predict
from pipewright.cost import frameworks
from pipewright.cost.fidelity import (
    Run,
    framework_fit_selection,
    framework_of,
    load_runs,
    mispriced_mechanism,
    published_tokens_per_s,
)

DU, DTAU, DDELTA = 0.1, 1e-4, 2e-6
ITERATIONS = 3


@contextlib.contextmanager
def calibrated(name: str, u: float, tau: float) -> Iterator[None]:
    """The framework ``name`` registered with c = 1/(1 + u) and τ_f = tau while the block runs."""
    saved = frameworks.framework(name)
    frameworks.register(replace(saved, compute=1.0 / (1.0 + u), overhead=tau), override=True)
    try:
        yield
    finally:
        frameworks.register(saved, override=True)


def time_ratios(name: str, runs: Sequence[Run], u: float, tau: float) -> np.ndarray:
    """T_i / P_i for each run at (u, τ): published tokens/s over predicted tokens/s."""
    with calibrated(name, u, tau):
        out = []
        for run in runs:
            o = predict(run)
            if o.error:
                raise SystemExit(f"{run.id}: {o.error}")
            out.append(published_tokens_per_s(run, peak_for(run)) / o.predicted)
    return np.array(out)


def fit(name: str, runs: Sequence[Run]) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(u, τ_f, errors at c = 1 and τ_f = 0, errors at the fit) for ``runs`` (module docstring)."""
    with_tau = len(runs) >= 3
    x = np.zeros(2)
    start = time_ratios(name, runs, 0.0, 0.0)
    for _ in range(ITERATIONS):
        base = time_ratios(name, runs, *x)
        cols = [(time_ratios(name, runs, x[0] + DU, x[1]) - base) / DU]
        if with_tau:
            cols.append((time_ratios(name, runs, x[0], x[1] + DTAU) - base) / DTAU)
        jac = np.stack(cols, axis=1)
        step, *_ = np.linalg.lstsq(jac, -(base - 1.0), rcond=None)
        new = x.copy()
        new[: len(step)] += step
        if with_tau and new[1] < 0:  # τ_f ≥ 0: refit u alone at τ_f = 0
            new[1] = 0.0
            step_u, *_ = np.linalg.lstsq(jac[:, :1], -(base - 1.0) - jac[:, 1] * (0.0 - x[1]), rcond=None)
            new[0] = x[0] + step_u[0]
        x = new
    final = time_ratios(name, runs, *x)
    return float(x[0]), float(x[1]), start - 1.0, final - 1.0


def joint(name: str, published: Sequence[Run]) -> None:
    """A framework fitted on a measured sweep too (``Framework.fitted_measured``; deepspeed-megatron: the
    fit half of vTrain's runs, :mod:`pipewright.cost.measured`): (u, δ) by Gauss–Newton on both sets
    at once, each set's residuals weighted by 1/√rows (each set counts alike, however many rows it
    has); τ_f stays 0 (the launches' δ prices the per-kernel cost). Prints c, δ and both sets' errors."""
    from pipewright.cli.calibrate import flag_setup, predict_all
    from pipewright.cost.measured import split, vtrain_runs
    from pipewright.cost.run_fit import Fitted, registered

    fw = frameworks.framework(name)
    sweep = split(vtrain_runs())[0]
    setup = ["--gpu", "a100-80gb", "--vocab", "50257", "--framework", name, "--dtype", "fp16"]
    setup += ["--attention", "eager", "--recompute", "full", "--grad-reduce", "after"]
    measured = np.array([r.seconds for r in sweep])

    def residuals(u: float, delta: float) -> np.ndarray:
        with registered(Fitted(name, fw.dispatch, 1.0 / (1.0 + u), delta)):
            swept = np.array(predict_all(sweep, flag_setup(setup))) / measured - 1.0
            rows = np.array(
                [published_tokens_per_s(r, peak_for(r)) / predict(r).predicted for r in published]
            )
        return np.concatenate([swept / np.sqrt(len(swept)), (rows - 1.0) / np.sqrt(len(rows))])

    x = np.array([1.0 / fw.compute - 1.0, fw.host_per_kernel])
    start = residuals(*x)
    for _ in range(ITERATIONS):
        base = residuals(*x)
        jac = np.stack(
            [(residuals(x[0] + DU, x[1]) - base) / DU, (residuals(x[0], x[1] + DDELTA) - base) / DDELTA], 1
        )
        step, *_ = np.linalg.lstsq(jac, -base, rcond=None)
        x = np.maximum(x + step, [-0.5, 0.0])
    final = residuals(*x)
    n = len(sweep)
    for label, r0, r1 in (
        ("vTrain fit half", start[:n], final[:n]),
        ("published fit rows", start[n:], final[n:]),
    ):
        print(f"  {label}: rms {np.sqrt(np.sum(r0**2)):.1%} -> {np.sqrt(np.sum(r1**2)):.1%}")
    c = 1.0 / (1.0 + x[0])
    print(f"\n{name}: joint fit; c = {c:.4f}, delta = {x[1] * 1e6:.2f} us")
    ids = tuple(r.id for r in published)
    print(f"  registry: compute={c:.4f}, host_per_kernel={x[1]:.4e}, fitted_on={ids!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="fit this framework only")
    parser.add_argument(
        "--complement",
        action="store_true",
        help="fit on the rows the rule holds out (mispriced mechanisms still left out): how stable the "
        "parameters are; the registry is not fitted this way",
    )
    args = parser.parse_args()
    runs = load_runs()
    names = [n for n in frameworks.names() if n != frameworks.DEFAULT_FRAMEWORK]
    for name in names:
        if args.only and name != args.only:
            continue
        ids = framework_fit_selection(runs, name)
        if frameworks.framework(name).fitted_measured and not args.complement:
            joint(name, [r for r in runs if r.id in ids])
            continue
        total = sum(framework_of(r) == name for r in runs)
        if args.complement:
            held = [r for r in runs if framework_of(r) == name and r.id not in ids]
            ids = tuple(r.id for r in held if not mispriced_mechanism(r))
        if not ids:
            print(f"{name}: no fit rows")
            continue
        chosen = [r for r in runs if r.id in ids]
        u, tau, before, after = fit(name, chosen)
        c = 1.0 / (1.0 + u)
        print(f"\n{name}: {len(ids)} fit rows of {total}; c = {c:.4f}, tau_f = {tau * 1e3:.4f} ms")
        for run, b, a in zip(chosen, before, after, strict=True):
            print(f"  {run.id:45s} time error {b:+7.1%} -> {a:+7.1%}")
        print(f"  rms {np.sqrt(np.mean(before**2)):.1%} -> {np.sqrt(np.mean(after**2)):.1%}")
        print(f"  registry: compute={c:.4f}, overhead={tau:.3e}, fitted_on={ids!r}")


if __name__ == "__main__":
    main()
