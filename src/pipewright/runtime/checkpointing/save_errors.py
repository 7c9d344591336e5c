"""A checkpoint save that fails says which file, which rank and why, in one line, and the run does what
``--on-save-error`` says: ``stop`` (default: the run fails with that line), ``retry`` (up to
:data:`RETRIES` more attempts, ``RETRY_WAIT_S``·attempt apart, then stop) or ``skip`` (a warning; training
goes on and the next save tries again). The previous checkpoint is never touched: a save writes into
``step_K.tmp`` and only a complete one replaces ``latest`` (:func:`~.checkpoint.save_checkpoint`).

DCP reports a failed save as ``CheckpointException`` holding each failed rank's exception; its message
alone is ``ranks:dict_keys([0, 1])``. :func:`describe` turns it (or rank 0's own error while committing)
into ``rank 0: permission denied writing /run/checkpoints/step_4.tmp/__0_0.distcp``. Every rank sees the
same outcome (DCP gathers the ranks' results; rank 0's commit error is broadcast), so every rank
retries or skips together.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pipewright.errors import PipewrightError

log = logging.getLogger(__name__)

SAVE_POLICIES = ("stop", "retry", "skip")
RETRIES = 2
RETRY_WAIT_S = 1.0

T = TypeVar("T")

_WHY = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (disk full or a file-size limit)",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
    errno.ENOENT: "folder removed",
}


class CheckpointSaveError(PipewrightError):
    """A checkpoint could not be written; the message is one line naming rank, file and cause."""


def _os_error(exc: BaseException) -> OSError | None:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _rank_file(folder: Path | None, rank: int | None) -> str | None:
    """The newest file DCP writes for ``rank`` (``__<rank>_<n>.distcp``) in ``folder``, else the folder:
    a failed ``write`` names no file."""
    if folder is None:
        return None
    files = (
        sorted(folder.glob(f"__{rank or 0}_*"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    )
    return str(files[-1] if files else folder)


def describe_error(exc: BaseException, rank: int | None = None, folder: Path | None = None) -> str:
    """``rank R: <why> writing <file>`` for an OSError somewhere in ``exc``'s chain, else its first line.
    ``folder``: where the rank was writing (to name the file when the error does not)."""
    who = "" if rank is None else f"rank {rank}: "
    os_exc = _os_error(exc)
    if os_exc is not None:
        why = _WHY.get(os_exc.errno or -1, os_exc.strerror or type(os_exc).__name__)
        target = os_exc.filename or _rank_file(folder, rank)
        return f"{who}{why}" + (f" writing {target}" if target else "")
    first = (str(exc).splitlines() or [""])[0]
    return f"{who}{type(exc).__name__}: {first}"


def describe(exc: BaseException, folder: Path | None = None, rank: int = 0) -> str:
    """One line for a failed save: each failed rank's cause (DCP's ``failures``), else the exception
    (raised on ``rank``); ``folder``: the checkpoint's ``.tmp`` folder."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback) pairs
            parts.append(describe_error(inner if isinstance(inner, BaseException) else exc, rank, folder))
        return "; ".join(parts)
    return describe_error(exc, rank, folder)


def kept(final: object) -> str:
    """What a failed save of ``final`` (``…/checkpoints/step_K``) leaves: an earlier checkpoint (a finished
    one: its ``meta.json`` written) or none."""
    path = Path(str(final))
    earlier = [
        p
        for p in path.parent.glob("step_*")
        if p.name != path.name and p.suffix != ".tmp" and (p / "meta.json").is_file()
    ]
    return "the previous checkpoint is kept" if earlier else "there is no earlier checkpoint"


def save_failed(final: object, why: str) -> str:
    return f"saving checkpoint {final} failed ({why}); {kept(final)}"


def raise_shared(error: str | None, final: object, group: object = None) -> None:
    """Rank 0's error (or None), seen by every rank, which then all raise it: a collective outcome
    (over ``group``, default the default group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    if error is not None:
        raise CheckpointSaveError(save_failed(final, error))


def with_policy(save: Callable[[], T], policy: str, what: str) -> T | None:
    """Run ``save`` under ``--on-save-error policy``; ``what`` names the checkpoint. Returns None when
    a failed save was skipped."""
    if policy not in SAVE_POLICIES:
        raise CheckpointSaveError(f"--on-save-error {policy!r}: choose one of {', '.join(SAVE_POLICIES)}")
    attempts = 1 + (RETRIES if policy == "retry" else 0)
    for attempt in range(1, attempts + 1):
        try:
            return save()
        except CheckpointSaveError as exc:
            if attempt < attempts:
                log.warning("warning: %s; retrying (%d of %d)", exc, attempt, RETRIES)
                time.sleep(RETRY_WAIT_S * attempt)
                continue
            if policy == "skip":
                log.warning("warning: %s; skipped (--on-save-error skip)", exc)
                return None
            raise
    return None
