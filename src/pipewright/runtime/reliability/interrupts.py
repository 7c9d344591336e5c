"""Ctrl-C (SIGINT) ends a run as a preemption (SIGTERM) does: the workers finish the step, write a
checkpoint where one is due and stop; ``pipewright train`` prints one line with the ``--resume`` hint
and exits :data:`INTERRUPTED_EXIT_CODE` (128 + SIGINT, the shell's code for Ctrl-C).

A terminal's Ctrl-C reaches every process of the foreground group, the workers included, each of which
would raise ``KeyboardInterrupt`` wherever it is (a traceback per process, no checkpoint). So the
workers ignore SIGINT — it is ignored while they are started, and a spawned interpreter keeps an
ignored SIGINT — and only the launching process handles it: it sends the workers one SIGTERM (the
preemption path, :class:`pipewright.runtime.reliability.elastic.Preemption`), and a second Ctrl-C a second
SIGTERM,
which ends a worker at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: exit status of ``pipewright train`` after Ctrl-C
INTERRUPTED_EXIT_CODE = 130
#: set in the launching process when SIGINT stopped the run (SIGTERM: not set)
INTERRUPTED = threading.Event()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def workers_ignore_sigint() -> Iterator[None]:
    """While starting workers: SIGINT ignored, so the processes started inherit an ignored SIGINT."""
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def forwarding_signals(processes: list) -> Iterator[None]:
    """While waiting for the workers: a SIGTERM or SIGINT to this process is sent on to each live
    worker as SIGTERM (SIGINT also sets :data:`INTERRUPTED`)."""
    if not _main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            if not INTERRUPTED.is_set():
                log.warning("interrupted: finishing the step, then a checkpoint (Ctrl-C again: stop now)")
            INTERRUPTED.set()
        else:
            log.warning("SIGTERM: passing it on to the workers")
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
