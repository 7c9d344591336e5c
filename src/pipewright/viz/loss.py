"""Loss curve PNG from a run's ``metrics.jsonl`` (one JSON object per line)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipewright.data.data_errors import DataError

_SMOOTH_MIN_POINTS = 50  # below this many steps the raw curve is readable on its own


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines file; blank lines are skipped, a malformed line raises DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"metrics file not found: {path}")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: not a JSON object ({exc})") from exc
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{lineno}: not a JSON object")
        records.append(rec)
    return records


def _ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with alpha = 2 / (span + 1), started at the first value."""
    alpha, out, acc = 2.0 / (span + 1), [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None and "step" in r]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_loss(
    metrics_jsonl_path: str | os.PathLike, png_path: str | os.PathLike, title: str | None = None
) -> Path:
    """Plot training ``loss`` per ``step`` (with an EMA when there are many steps) and the ``val_loss``
    points, if any, from ``metrics_jsonl_path`` into ``png_path``. Returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl_path)
    steps, loss = _series(records, "loss")
    vsteps, vloss = _series(records, "val_loss")
    if not steps and not vsteps:
        raise DataError(f"{metrics_jsonl_path}: no records with 'step' and 'loss' or 'val_loss'")

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    if steps:
        many = len(steps) >= _SMOOTH_MIN_POINTS
        ax.plot(steps, loss, color="tab:blue", lw=1.0, alpha=0.35 if many else 1.0, label="train loss")
        if many:
            span = max(5, len(steps) // 25)
            ax.plot(steps, _ema(loss, span), color="tab:blue", lw=1.8, label=f"train loss (EMA, span {span})")
    if vsteps:
        ax.plot(vsteps, vloss, "o-", color="tab:orange", ms=4, lw=1.2, label="validation loss")
    last = f"final train loss {loss[-1]:.3f}" if steps else f"final val loss {vloss[-1]:.3f}"
    ax.set_title(title or f"Loss per step ({last})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
