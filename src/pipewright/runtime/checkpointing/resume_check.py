"""Which model dimensions differ between a checkpoint and the run resuming it, for the one-line refusal
(``--resume: checkpoint … was saved with --layers 6; this run has --layers 4``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields

from pipewright.models.spec import ModelSpec

_IGNORED = ("name",)


def model_difference(meta: Mapping, spec: ModelSpec, tp: int, current: Mapping | None = None) -> str:
    """``--layers 6 (this run: 4), --tp 2 (this run: 1)`` from the checkpoint's recorded config; with
    the run's flat config ``current``, also the data and tokenizer (the vocabulary comes from them);
    empty when it cannot be rebuilt (an older checkpoint)."""
    from pipewright.runtime.setup.config import TrainConfig

    saved = meta.get("config")
    if not isinstance(saved, Mapping):
        return ""
    known = {f.name for f in fields(TrainConfig)}
    try:
        config = TrainConfig(**{k: v for k, v in saved.items() if k in known})
        theirs = asdict(config.model_spec(None if config.vocab else spec.vocab))
    except Exception:  # an old or hand-edited record: fall back to the generic message
        return ""
    ours = asdict(spec)
    diff = [
        f"--{k.replace('_', '-')} {theirs[k]} (this run: {ours[k]})"
        for k in ours
        if k not in _IGNORED and theirs.get(k) != ours[k]
    ]
    if config.tp != tp and not diff:
        diff.append(f"--tp {config.tp} (this run: {tp})")
    for key in ("data", "tokenizer") if current is not None and not diff else ():
        if saved.get(key) != current.get(key):
            diff.append(f"--{key} {saved.get(key) or 'default'} (this run: {current.get(key) or 'default'})")
    return ", ".join(diff)
