"""A framework's calibration fitted on measured runs (``pipewright calibrate``), and its file.

Two parameters of the framework priced (:class:`pipewright.cost.frameworks.Framework`): the compute
factor c (GEMM time × 1/c) and the host seconds per kernel launch δ of its dispatch model
(:mod:`pipewright.cost.dispatch`). With x = (u, δ), c = 1/(1 + u), each fit row's relative error is
r_i(x) = T_i(x) / M_i − 1 (T simulated, M measured); the fit minimises Σ r_i² by Gauss–Newton, the
Jacobian by finite differences (Δu = 0.05, Δδ = 2 µs), :data:`ITERATIONS` steps from the framework's
registered values, δ clamped at ≥ 0.

The file (JSON) ``calibrate`` writes and ``simulate``/``plan --calibration FILE`` read::

    {"format": "pipewright-run-calibration/1", "accelerator": "a100-80gb",
     "framework": "deepspeed-megatron", "dispatch": "eager", "compute": 0.80, "host_per_kernel": 4.1e-05,
     "measured": "runs.csv", "fit_rows": 360, "held_out": {"mape": 0.05, ...},
     "shapes": [{"family": "gpt", "hidden": 1024, …, "tp": 2, "microbatch": 4, "layers": 0.85,
                 "ends": 0.95, "rows": 20}, …]}

``shapes``: each layer shape measured in the fit runs with its factors (:func:`fit_shapes`,
:mod:`pipewright.cost.shape_scales`). Read (:func:`pipewright.cost.calibration.parse_run_calibration`),
it is a :class:`~pipewright.cost.calibration.Calibration` without GEMM points whose ``fitted`` constants
replace the framework's (:func:`apply_fitted`) and whose ``shapes`` scale the passes of those shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipewright.cost import frameworks
from pipewright.cost.calibration import RUN_FORMAT, Calibration
from pipewright.cost.efficiency import Efficiency, default_efficiency
from pipewright.cost.measured import MeasuredRun
from pipewright.cost.shape_scales import MIN_ROWS, Shape, ShapeScale, shapes_json
from pipewright.errors import ConfigError
from pipewright.hardware import accelerator

DU, DDELTA = 0.05, 2e-6
ITERATIONS = 3
#: the finite-difference step of a shape's log-factors, and their bound (factors within 1/4 … 4)
DLOG, LOG_BOUND = 0.05, math.log(4.0)


@dataclass(frozen=True)
class Fitted:
    """The fitted constants of ``framework`` (module docstring)."""

    framework: str
    dispatch: str
    compute: float
    host_per_kernel: float


@contextlib.contextmanager
def registered(fit: Fitted) -> Iterator[None]:
    """``fit``'s constants registered under its framework's name while the block runs."""
    saved = frameworks.framework(fit.framework)
    candidate = replace(
        saved, compute=fit.compute, host_per_kernel=fit.host_per_kernel, dispatch=fit.dispatch
    )
    frameworks.register(candidate, override=True)
    try:
        yield
    finally:
        frameworks.register(saved, override=True)


#: predicted seconds of runs under the shared settings (``calibrate``'s RunSpec values by path), with
#: a per-row progress callback
Predict = Callable[[Sequence[MeasuredRun], Any, Callable[[int, int], None]], list[float]]


def fit_runs(
    runs: Sequence[MeasuredRun],
    setup: Any,
    framework: str,
    predict: Predict,
    progress: Callable[[int, int], None] | None = None,
) -> Fitted:
    """Gauss–Newton fit of (c, δ) on ``runs`` (module docstring), each candidate's times by ``predict``
    (the command line's simulation, :func:`pipewright.cli.calibrate.predict_all`); ``progress(done,
    total)`` per row simulated."""
    import numpy as np

    fw = frameworks.framework(framework)
    total = (ITERATIONS * 3) * len(runs)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    measured = np.array([r.seconds for r in runs])

    def residuals(u: float, delta: float) -> Any:
        fit = Fitted(fw.name, fw.dispatch, 1.0 / (1.0 + u), max(delta, 0.0))
        with registered(fit):
            times = predict(runs, setup, lambda done, total: tick(1))
        return np.array(times) / measured - 1.0

    x = np.array([1.0 / fw.compute - 1.0, fw.host_per_kernel or 3e-5])
    for _ in range(ITERATIONS):
        base = residuals(*x)
        jac = np.stack(
            [
                (residuals(x[0] + DU, x[1]) - base) / DU,
                (residuals(x[0], x[1] + DDELTA) - base) / DDELTA,
            ],
            axis=1,
        )
        step, *_ = np.linalg.lstsq(jac, -base, rcond=None)
        x = x + step
        x[0] = max(x[0], -0.5)  # c ≤ 2
        x[1] = max(x[1], 0.0)
    return Fitted(fw.name, fw.dispatch, float(1.0 / (1.0 + x[0])), float(x[1]))


def fit_shapes(
    runs: Sequence[MeasuredRun],
    setup: Any,
    fit: Fitted,
    gpu: str,
    predict: Predict,
    shape_of_run: Callable[[MeasuredRun], Shape],
    progress: Callable[[int, int], None] | None = None,
) -> dict[Shape, ShapeScale]:
    """Each :class:`~pipewright.cost.shape_scales.Shape` of ``runs`` measured in at least
    :data:`~pipewright.cost.shape_scales.MIN_ROWS` of them, with its (layers, ends) factors: with
    x = (ln k_layers, ln k_ends) and r_i(x) = ln(T_i(x) / M_i) over the shape's runs, Gauss–Newton
    minimises Σ r_i², :data:`ITERATIONS` steps from x = 0, the Jacobian by finite differences
    (Δ = :data:`DLOG`), x clamped to ±ln 4 (:mod:`pipewright.cost.shape_scales`). T_i is priced through
    a calibration file of ``fit``'s constants and the candidate factors, as ``simulate
    --calibration`` reads it (``setup`` gains its path)."""
    import numpy as np

    groups: dict[Shape, list[MeasuredRun]] = {}
    for run in runs:
        groups.setdefault(shape_of_run(run), []).append(run)
    fitted = {k: v for k, v in groups.items() if len(v) >= MIN_ROWS}
    total, done = (ITERATIONS + 3) * sum(map(len, fitted.values())), [0]

    def tick(*_: int) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    scales: dict[Shape, ShapeScale] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.json"
        trial_setup = {**setup, ("cluster", "calibration"): str(path)}
        for shape, rows in fitted.items():
            measured = np.array([r.seconds for r in rows])

            def residuals(x: Any, shape: Shape = shape, rows: list = rows, measured: Any = measured) -> Any:
                trial = {**scales, shape: ShapeScale(*np.exp(x), len(rows))}
                path.write_text(json.dumps(calibration_json(fit, gpu, trial)))
                return np.log(np.array(predict(rows, trial_setup, tick)) / measured)

            x, base = np.zeros(2), residuals(np.zeros(2))
            jac = np.stack([(residuals(DLOG * e) - base) / DLOG for e in np.eye(2)], axis=1)
            for _ in range(ITERATIONS):  # the Jacobian at x = 0 throughout: r is close to linear in x
                step, *_ = np.linalg.lstsq(jac, -base, rcond=None)
                x = np.clip(x + step, -LOG_BOUND, LOG_BOUND)
                base = residuals(x)
            scales[shape] = ShapeScale(float(np.exp(x[0])), float(np.exp(x[1])), len(rows))
    return scales


@contextlib.contextmanager
def calibration_file(fit: Fitted, gpu: str, shapes: Mapping[Shape, ShapeScale]) -> Iterator[str]:
    """The path of a calibration file of ``fit`` and ``shapes`` while the block runs (removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.json"
        path.write_text(json.dumps(calibration_json(fit, gpu, shapes)))
        yield str(path)


def calibration_json(
    fit: Fitted,
    gpu: str,
    shapes: Mapping[Shape, ShapeScale] | None = None,
    measured: str = "",
    fit_rows: int = 0,
    held_out: Mapping | None = None,
) -> dict:
    """The file's object (module docstring)."""
    return {
        "format": RUN_FORMAT,
        "accelerator": gpu,
        "framework": fit.framework,
        "dispatch": fit.dispatch,
        "compute": round(fit.compute, 6),
        "host_per_kernel": float(f"{fit.host_per_kernel:.4e}"),
        "measured": measured,
        "fit_rows": fit_rows,
        "held_out": dict(held_out or {}),
        "shapes": shapes_json(shapes or {}),
    }


def apply_fitted(efficiency: Efficiency, calibration: Calibration, gpu: str) -> Efficiency:
    """``efficiency`` with a run calibration's constants: the GEMM efficiency the accelerator's default
    × the fitted c, the fitted dispatch model and δ (unchanged without fitted constants)."""
    fitted = getattr(calibration, "fitted", None)
    if not fitted:
        return efficiency
    base = default_efficiency(accelerator(gpu)).gemm
    return replace(
        efficiency,
        gemm=base * fitted["compute"],
        host_per_kernel=fitted["host_per_kernel"],
        dispatch=calibration.dispatch,
    )


def write(path: str | Path, data: Mapping, overwrite: bool) -> None:
    """Write ``data`` as JSON to ``path``; a one-line error if it exists and ``overwrite`` is off."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass --overwrite to replace it")
    path.write_text(json.dumps(data, indent=2) + "\n")
