"""What a calibration file must hold before any number of it prices a layout: the types of
:mod:`pipewright.cost.calibration`'s format, every measurement finite, positive and below what any
device reaches, so a hand-edited or damaged file (a negative GEMM rate, ``NaN`` seconds, an infinite
bandwidth, ``"tflops": "fast"``) is refused in one line naming the file and the field instead of
printing a negative iteration time.

Upper bounds (well above any device of 2026, below what a typo gives): a GEMM rate of
:data:`MAX_TFLOPS` TFLOP/s, a memory bandwidth of :data:`MAX_BANDWIDTH` bytes/s (a link the same), a
latency of :data:`MAX_LATENCY_S`, a GEMM dimension of :data:`MAX_DIM`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipewright.errors import ConfigError

MAX_TFLOPS = 1e5
MAX_BANDWIDTH = 1e15
MAX_LATENCY_S = 1.0
MAX_DIM = 1 << 24


def _number(item: Mapping[str, Any], key: str, at: str, low: float, high: float, *, strict: bool) -> None:
    value = item.get(key)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and math.isfinite(value) and (value > low if strict else value >= low) and value <= high:
        return
    kind = "a positive" if strict else "a non-negative"
    raise ConfigError(f"{at}: {key!r} must be {kind} number at most {high:g} (got {value!r:.40})")


def _string(item: Mapping[str, Any], key: str, at: str) -> None:
    if key in item and not isinstance(item[key], str):
        raise ConfigError(f"{at}: {key!r} must be a string (got {item[key]!r:.40})")


def check_calibration(data: Any, where: str) -> None:
    """One-line ConfigError unless the parsed JSON ``data`` is a calibration whose fields have the right
    types and finite values in range (module docstring); ``where`` names the file."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: not a JSON object")
    for key in ("format", "accelerator", "dtype", "device_name", "measured_at", "torch"):
        _string(data, key, where)
    gemm = data.get("gemm")
    if not isinstance(gemm, list) or not gemm:
        raise ConfigError(f"{where}: 'gemm' must be a non-empty list of measured GEMMs")
    for i, item in enumerate(gemm):
        at = f"{where}: gemm[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at} is not an object")
        for key in ("m", "n", "k"):
            value = item.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
                raise ConfigError(f"{at}: {key!r} must be an integer in 1..{MAX_DIM} (got {value!r:.40})")
        _number(item, "seconds", at, 0.0, 1e6, strict=True)
        if "tflops" in item:
            _number(item, "tflops", at, 0.0, MAX_TFLOPS, strict=True)
        _string(item, "dtype", at)
    if "memory_bandwidth" in data:
        _number(data, "memory_bandwidth", where, 0.0, MAX_BANDWIDTH, strict=True)
    links = data.get("links", {})
    if not isinstance(links, Mapping):
        raise ConfigError(f"{where}: 'links' must be an object")
    for name, item in links.items():
        at = f"{where}: links.{name}"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at} is not an object")
        _number(item, "bandwidth", at, 0.0, MAX_BANDWIDTH, strict=True)
        if "latency" in item:
            _number(item, "latency", at, 0.0, MAX_LATENCY_S, strict=False)
