"""Bounded waits for collectives: every blocking collective of a run gives up after a timeout.

Two mechanisms, one timeout (``--collective-timeout``):

* the collectives pipewright starts asynchronously (the data-parallel gradient all-reduce, the
  iteration's loss all-reduce, the per-step flag all-reduce, the timing barrier) are waited with
  :func:`wait_work`: ``work.wait(timeout)`` on gloo, a polled deadline on CUDA (``is_completed``: a
  NCCL ``wait`` only orders streams, it does not block the host);
* every other collective — synchronous ones in features' handlers (``executor.group(name)``), the
  gradient-norm all-reduce, checkpoint barriers — is bounded by its process group's own timeout, which
  :func:`bound_groups` sets for every gloo group this process belongs to. gloo raises a RuntimeError
  ("Timed out waiting ...") when it expires; :func:`is_timeout` recognises it.

Either way the caller turns the timeout into a :class:`~pipewright.runtime.errors.CollectiveTimeout`
and the guard into a hang report (:mod:`pipewright.runtime.hang`). On NCCL a group's timeout is
enforced by its watchdog, which aborts the process: only the waits of the first kind report there.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipewright.runtime.errors import CollectiveTimeout

log = logging.getLogger(__name__)

#: Substrings of the messages gloo and c10d raise when an operation's timeout expires.
_TIMEOUT_MARKS = ("timed out", "timeout caused pair closure")


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a c10d/gloo operation timeout."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(mark in text for mark in _TIMEOUT_MARKS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def wait_work(work: dist.Work, timeout_s: float, device: torch.device) -> bool:
    """Wait for ``work`` at most ``timeout_s`` seconds; False when it did not complete in time."""
    if device.type != "cuda":
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if is_timeout(exc):
                return False
            raise
        return True
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(20e-6)
    work.wait()  # orders the current stream after the collective
    return True


def wait_or_raise(work: dist.Work, timeout_s: float | None, device: torch.device, what: str) -> None:
    """Wait for ``work`` (without limit when ``timeout_s`` is None); a
    :class:`~pipewright.runtime.errors.CollectiveTimeout` naming ``what`` when it does not complete in
    ``timeout_s`` seconds."""
    if timeout_s is None:
        work.wait()
    elif not wait_work(work, timeout_s, device):
        raise CollectiveTimeout(f"{what} did not complete within {timeout_s:g} s")


def bound_groups(timeout_s: float) -> int:
    """Set the timeout of every gloo process group this process belongs to (default group included) to
    ``timeout_s``; returns how many were set. NCCL groups keep theirs (their watchdog aborts)."""
    if not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:  # an older or newer torch without it: the groups keep their init timeout
        log.warning("this torch has no _set_pg_timeout: collectives keep their process groups' timeouts")
        return 0
    count = 0
    for group in list(c10d._world.pg_map):
        if c10d._rank_not_in_group(group):
            continue
        if "nccl" in str(dist.get_backend(group)):
            continue  # NCCL: its watchdog aborts the process at the timeout, no report possible
        try:
            setter(timedelta(seconds=timeout_s), group)
            count += 1
        except (RuntimeError, ValueError, AssertionError):
            continue
    return count
