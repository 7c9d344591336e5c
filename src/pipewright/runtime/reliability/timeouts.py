"""Bounded waits for collectives: every blocking collective of a run gives up after a timeout.

Two mechanisms, one timeout (``--collective-timeout``):

* the collectives pipewright starts asynchronously (the data-parallel gradient all-reduce, the
  iteration's loss all-reduce, the per-step flag all-reduce, the timing barrier) are waited with
  :func:`wait_work`: ``work.wait(timeout)`` on gloo, a polled deadline on CUDA (``is_completed``: a
  NCCL ``wait`` only orders streams, it does not block the host) — except the step's gradient
  reductions, which on CUDA only order the stream and have their deadline checked once at the step's
  end (:class:`StreamWaits`), so the host keeps launching ahead;
* every other collective — synchronous ones in features' handlers (``executor.group(name)``), the
  gradient-norm all-reduce, checkpoint barriers — is bounded by its process group's own timeout, which
  :func:`bound_groups` sets for every gloo group this process belongs to. gloo raises a RuntimeError
  ("Timed out waiting ...") when it expires; :func:`is_timeout` recognises it.

Either way the caller turns the timeout into a
:class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout`
and the guard into a hang report (:mod:`pipewright.runtime.reliability.hang`).

On NCCL a group's timeout is enforced by its watchdog, which aborts the process. So that the host's
deadline fires and the hang report is written first, every NCCL group — the default one
(:func:`~pipewright.runtime.setup.launch.init_from_env`, which also binds it to ``cuda:LOCAL_RANK`` with
``device_id``), each :func:`new_group` and, once the run's timeout is known, every group
:func:`bound_groups` finds — gets :func:`watchdog_timeout`: ``--collective-timeout`` plus
:data:`REPORT_MARGIN_S`. After a hang report, :func:`abort_device_groups` aborts the NCCL
communicators, so that tearing the process down does not wait on kernels that will never complete.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipewright.runtime.core.distributed_errors import CollectiveTimeout

log = logging.getLogger(__name__)

#: Seconds NCCL's watchdog waits beyond ``--collective-timeout``: the hang report (every rank's
#: position gathered through the store, the first reporter's grace of a few seconds and the others'
#: ten-second wait for it; :mod:`pipewright.runtime.reliability.hang`) is written well within it.
REPORT_MARGIN_S = 120.0

#: The timeout :func:`new_group` gives new groups by backend ("nccl": set by ``init_from_env``; both
#: by :func:`bound_groups`; absent: torch's default).
_group_timeouts: dict[str, timedelta] = {}

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


class StreamWaits:
    """A step's asynchronous collectives waited without blocking the host on CUDA: :meth:`wait` orders
    the compute stream after the work (NCCL's ``work.wait()``; the host goes on launching) and keeps
    it; :meth:`check`, once when the step's communication is done, checks each one's deadline (a
    :class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout` naming the first that did not
    complete), as
    the point-to-point receives' deadlines are checked. Elsewhere (gloo) :meth:`wait` blocks, bounded."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, float, str]] = []

    def wait(self, work: dist.Work, timeout_s: float, device: torch.device, what: str) -> None:
        """Wait for ``work`` (see the class docstring); ``what`` names it in the timeout's message."""
        if device.type != "cuda":
            if not wait_work(work, timeout_s, device):
                raise CollectiveTimeout(f"{what} did not complete within {timeout_s:g} s")
            return
        work.wait()  # orders the current stream after the collective
        self.pending.append((work, timeout_s, what))

    def check(self, device: torch.device) -> None:
        """The deadlines of the works :meth:`wait` ordered the stream after (CUDA; none elsewhere)."""
        pending, self.pending = self.pending, []
        for work, timeout_s, what in pending:
            if not wait_work(work, timeout_s, device):
                raise CollectiveTimeout(f"{what} did not complete within {timeout_s:g} s")


def wait_or_raise(work: dist.Work, timeout_s: float | None, device: torch.device, what: str) -> None:
    """Wait for ``work`` (without limit when ``timeout_s`` is None); a
    :class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout` naming ``what`` when it does not
    complete in
    ``timeout_s`` seconds."""
    if timeout_s is None:
        work.wait()
    elif not wait_work(work, timeout_s, device):
        raise CollectiveTimeout(f"{what} did not complete within {timeout_s:g} s")


def watchdog_timeout(collective_timeout_s: float) -> timedelta:
    """The timeout of a NCCL process group: ``collective_timeout_s`` + :data:`REPORT_MARGIN_S`, so that
    the host deadline (and its hang report) comes before NCCL's watchdog aborts the process."""
    return timedelta(seconds=collective_timeout_s + REPORT_MARGIN_S)


def use_nccl_group_timeout(collective_timeout_s: float) -> None:
    """From now on :func:`new_group` gives NCCL groups :func:`watchdog_timeout`."""
    _group_timeouts["nccl"] = watchdog_timeout(collective_timeout_s)


def new_group(ranks, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, **kwargs)`` (collective over the default group) with the run's timeout
    for its backend: NCCL's watchdog above the hang report's deadline (:func:`watchdog_timeout`;
    torch's default would be 10 minutes whatever ``--collective-timeout`` says), gloo's the
    collective timeout itself. A NCCL group inherits the default group's ``device_id``."""
    backend = str(kwargs.get("backend") or (dist.get_backend() if dist.is_initialized() else ""))
    nccl = "nccl" in backend
    if nccl and "nccl" in _group_timeouts and "timeout" not in kwargs:
        kwargs["timeout"] = _group_timeouts["nccl"]
    group = dist.new_group(ranks, **kwargs)
    # gloo connects a new group's ranks within its timeout: the (short) collective timeout is set after
    if not nccl and "gloo" in _group_timeouts and "timeout" not in kwargs and group is not None:
        _set_timeout(group, _group_timeouts["gloo"])
    return group


def _set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> bool:
    """``group``'s timeout ← ``timeout`` (False where this torch or the group does not take it)."""
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None or c10d._rank_not_in_group(group):
        return False
    try:
        setter(timeout, group)
    except (RuntimeError, ValueError, AssertionError):
        return False
    return True


def abort_device_groups() -> bool:
    """After a hang report: abort every process group when the default one is NCCL (its kernels may
    never complete; destroying the groups would wait on them). Returns whether it aborted. gloo's
    groups are left to the normal teardown (nothing waits on a device)."""
    if not (dist.is_initialized() and "nccl" in str(dist.get_backend())):
        return False
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._abort_process_group()
    except (RuntimeError, ValueError) as exc:
        log.warning("aborting the process groups after the hang report failed: %s", exc)
        return False
    return True


def bound_groups(timeout_s: float) -> int:
    """Set the timeout of every process group this process belongs to (default group included):
    ``timeout_s`` for gloo's (their expiry is caught and reported), :func:`watchdog_timeout` for
    NCCL's (their watchdog aborts: it must wait for the hang report). Returns how many were set."""
    use_nccl_group_timeout(timeout_s)  # the groups created from now on
    _group_timeouts["gloo"] = timedelta(seconds=timeout_s)
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
        nccl = "nccl" in str(dist.get_backend(group))
        count += _set_timeout(group, watchdog_timeout(timeout_s) if nccl else timedelta(seconds=timeout_s))
    return count
