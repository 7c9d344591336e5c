"""Measured calibration of one accelerator: GEMM throughput by shape, kernel bandwidth, links.

The file ``pipewright profile --calibration OUT`` writes and ``simulate``/``plan --calibration FILE``
read (JSON)::

    {"format": "pipewright-calibration/1", "accelerator": "h100-sxm", "device_name": "NVIDIA H100 …",
     "dtype": "bf16", "measured_at": "2026-11-25", "torch": "2.13.0",
     "gemm": [{"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "seconds": 0.0016, "tflops": 690.0}],
     "memory_bandwidth": 2.9e12,
     "links": {"intra_node": {"bandwidth": 3.6e11, "latency": 3e-6}, "inter_node": {…}}}

``accelerator`` is a :mod:`pipewright.hardware` preset name (or "cpu"); ``memory_bandwidth`` the bytes/s
a large elementwise/copy kernel reaches; ``links`` (each optional) per-direction bytes/s and seconds.

A GEMM's throughput is interpolated from the measured points of its dtype: piecewise linear in
log(FLOPs) between the two nearest measured sizes, each size's throughput the mean over its points of
the most similar shape (nearest in log m, log n, log k); outside the measured range the nearest size's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pipewright.errors import ConfigError

FORMAT = "pipewright-calibration/1"
_REQUIRED = ("format", "accelerator", "dtype", "gemm", "memory_bandwidth")


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: m × n × k in ``dtype`` took ``seconds`` (``tflops`` = 2mnk / seconds / 1e12)."""

    m: int
    n: int
    k: int
    dtype: str
    seconds: float
    tflops: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class LinkCalibration:
    """A measured link: per-direction bytes/s and one-message seconds."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Calibration:
    """A measured calibration (module docstring)."""

    accelerator: str
    dtype: str
    gemm: tuple[GemmPoint, ...]
    memory_bandwidth: float
    device_name: str = ""
    measured_at: str = ""
    torch: str = ""
    links: Mapping[str, LinkCalibration] = field(default_factory=lambda: MappingProxyType({}))
    #: a framework's constants fitted on measured runs (``pipewright calibrate``; pipewright.cost.run_fit)
    fitted: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    dispatch: str = ""
    #: measured rates of the layer shapes of the runs fitted on (pipewright.cost.shape_scales)
    shapes: Mapping = field(default_factory=lambda: MappingProxyType({}))

    def gemm_flops_per_second(self, m: float, n: float, k: float, dtype: str | None = None) -> float | None:
        """Interpolated FLOP/s of an m × n × k GEMM (module docstring); None without points of
        ``dtype`` (default: the calibration's)."""
        points = [p for p in self.gemm if p.dtype == (dtype or self.dtype)]
        if not points:
            return None
        target = math.log(2.0 * m * n * k)

        def shape_distance(p: GemmPoint) -> float:
            return sum((math.log(a) - math.log(b)) ** 2 for a, b in ((p.m, m), (p.n, n), (p.k, k)))

        sizes: dict[float, list[GemmPoint]] = {}
        for p in points:
            sizes.setdefault(round(math.log(p.flops), 6), []).append(p)
        rates = {}
        for size, group in sizes.items():
            best = min(shape_distance(p) for p in group)
            near = [p.tflops for p in group if shape_distance(p) <= best + 1e-9]
            rates[size] = sum(near) / len(near) * 1e12
        keys = sorted(rates)
        if target <= keys[0]:
            return rates[keys[0]]
        if target >= keys[-1]:
            return rates[keys[-1]]
        hi = next(i for i, x in enumerate(keys) if x >= target)
        x0, x1 = keys[hi - 1], keys[hi]
        w = (target - x0) / (x1 - x0)
        return rates[x0] * (1 - w) + rates[x1] * w


def _positive(data: Mapping[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: {key!r} must be a positive number (got {value!r})")
    return float(value)


def parse_calibration(data: Mapping[str, Any], where: str = "calibration") -> Calibration:
    """A :class:`Calibration` from the JSON object; one-line ConfigError on a wrong format or a
    missing field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: not a JSON object")
    if data.get("format") != FORMAT:
        raise ConfigError(f"{where}: format must be {FORMAT!r} (got {data.get('format')!r})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    gemm = data["gemm"]
    if not isinstance(gemm, list) or not gemm:
        raise ConfigError(f"{where}: 'gemm' must be a non-empty list of measured GEMMs")
    points = []
    for i, item in enumerate(gemm):
        at = f"{where}: gemm[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at} is not an object")
        dims = [int(_positive(item, key, at)) for key in ("m", "n", "k")]
        seconds = _positive(item, "seconds", at)
        tflops = float(item["tflops"]) if "tflops" in item else 2 * math.prod(dims) / seconds / 1e12
        points.append(GemmPoint(*dims, str(item.get("dtype", data["dtype"])), seconds, tflops))
    links = {}
    raw_links = data.get("links") or {}
    if not isinstance(raw_links, Mapping):
        raise ConfigError(f"{where}: 'links' must be an object")
    for name, item in raw_links.items():
        if name not in ("intra_node", "inter_node"):
            raise ConfigError(f"{where}: unknown link {name!r}; use intra_node or inter_node")
        at = f"{where}: links.{name}"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at} is not an object")
        links[name] = LinkCalibration(_positive(item, "bandwidth", at), float(item.get("latency", 0.0)))
    return Calibration(
        accelerator=str(data["accelerator"]),
        dtype=str(data["dtype"]),
        gemm=tuple(points),
        memory_bandwidth=_positive(data, "memory_bandwidth", where),
        device_name=str(data.get("device_name", "")),
        measured_at=str(data.get("measured_at", "")),
        torch=str(data.get("torch", "")),
        links=MappingProxyType(links),
    )


def load_calibration(path: str | Path, accelerator_name: str | None = None) -> Calibration:
    """Read a calibration file; one-line ConfigError when it cannot be read, is not one, or was
    measured on another accelerator than ``accelerator_name`` (the ``--gpu`` priced)."""
    from pipewright.cost.calibration_check import check_calibration
    from pipewright.files import read_text

    path = Path(path)
    try:
        data = json.loads(read_text(path, "calibration"))  # one line for a missing or binary file too
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    if isinstance(data, Mapping) and data.get("format") == RUN_FORMAT:  # `pipewright calibrate`'s file
        cal = parse_run_calibration(data, f"calibration {path}")
    else:
        check_calibration(data, f"calibration {path}")  # types, finite values in range
        cal = parse_calibration(data, f"calibration {path}")
    if accelerator_name is not None and cal.accelerator != accelerator_name:
        raise ConfigError(
            f"calibration {path} was measured on {cal.accelerator!r}, not on --gpu {accelerator_name}; "
            "measure this GPU with `pipewright profile --calibration` or drop --calibration"
        )
    return cal


#: the format of the file ``pipewright calibrate`` writes (:mod:`pipewright.cost.run_fit`)
RUN_FORMAT = "pipewright-run-calibration/1"


def parse_run_calibration(data: Mapping[str, Any], where: str) -> Calibration:
    """A :class:`Calibration` of the file's object: no GEMM points, the accelerator's memory bandwidth,
    ``fitted`` the framework constants, ``shapes`` the measured shapes' factors
    (:mod:`pipewright.cost.shape_scales`); a one-line ConfigError naming a bad field."""
    gpu = data.get("accelerator")
    if not isinstance(gpu, str):
        raise ConfigError(f"{where}: 'accelerator' must be a GPU name")
    from pipewright.cost.dispatch import dispatch as dispatch_model
    from pipewright.hardware import accelerator

    acc = accelerator(gpu)
    for key in ("compute", "host_per_kernel"):
        value = data.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ConfigError(f"{where}: {key!r} must be a number ≥ 0 (got {value!r})")
    if not data["compute"] > 0:
        raise ConfigError(f"{where}: 'compute' must be > 0")
    name = str(data.get("dispatch", "fused"))
    dispatch_model(name)
    fitted = {"compute": float(data["compute"]), "host_per_kernel": float(data["host_per_kernel"])}
    from pipewright.cost.shape_scales import parse_shapes

    shapes = parse_shapes(data.get("shapes"), where)
    return Calibration(
        accelerator=gpu,
        dtype="",
        gemm=(),
        memory_bandwidth=acc.memory_bandwidth,
        measured_at=str(data.get("measured", "")),
        fitted=MappingProxyType(fitted),
        dispatch=name,
        shapes=MappingProxyType(shapes),
    )
