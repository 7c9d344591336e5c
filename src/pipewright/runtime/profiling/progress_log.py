"""How a run reports as it goes: metrics lines as strict JSON, and a progress bar only on a terminal.

- :func:`strict_json` — ``json.dumps`` with every NaN/±inf written as ``null`` (RFC 8259 has no
  ``NaN``/``Infinity``; Python's default output is rejected by strict readers such as ``jq``'s,
  JavaScript's ``JSON.parse`` or Go's ``encoding/json``).
- :func:`progress` — tqdm's bar when stderr is a terminal; otherwise (a log file, a pipe) one plain line
  every ``every`` steps and at the last step, so redirected logs hold no carriage-return redraws.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def strict_json(record: Any, **kwargs: Any) -> str:
    """``record`` as strict JSON: non-finite floats become null (see the module docstring)."""
    return json.dumps(_finite(record), allow_nan=False, **kwargs)


class PlainProgress:
    """A progress report for a non-terminal: ``train: step 40/200, loss 3.210, 12,345 tok_s`` every
    ``every`` steps (and at the last)."""

    def __init__(self, total: int, initial: int = 0, every: int = 10, stream: TextIO | None = None) -> None:
        self.total, self.n, self.every = total, initial, max(1, every)
        self.stream = stream or sys.stderr
        self.postfix: dict[str, str] = {}

    def set_postfix(self, **values: str) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
            print(f"train: step {self.n}/{self.total}{extra}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, initial: int, stream: TextIO | None = None):
    """tqdm's bar on a terminal, else :class:`PlainProgress` (a line per ``max(1, total // 20)`` steps)."""
    stream = stream or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=stream)
    return PlainProgress(total, initial, every=max(1, total // 20), stream=stream)
