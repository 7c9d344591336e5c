"""Start-up stage lines: what a run is doing before its first step, said only when it takes a while.

``with stage("building the model"):`` prints ``building the model… (5 s so far)`` to stderr when the
block is still running :data:`SLOW_S` seconds after it began, and ``building the model: done in 12.3 s``
when it then ends (not when it raises); a faster block prints nothing. On a terminal or not (a CI log
gets a few plain lines, no redraws). The stages of ``train`` and ``check``: checking the layout and the
data (the launching process), joining the process group, building the model, loading the checkpoint
and the first step (rank 0 of the workers).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

#: seconds a start-up stage runs before it is said
SLOW_S = 5.0


@contextmanager
def stage(what: str, *, enabled: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Say ``what`` when the block outlasts :data:`SLOW_S` seconds, and its duration when it ends (see
    the module); ``enabled=False``: nothing (e.g. ranks other than 0)."""
    if not enabled:
        yield
        return
    out = stream or sys.stderr
    slow, start = SLOW_S, time.monotonic()
    done, said = threading.Event(), threading.Event()

    def watch() -> None:
        if not done.wait(slow):
            print(f"{what}… ({slow:g} s so far)", file=out, flush=True)
            said.set()

    watcher = threading.Thread(target=watch, name="pipewright-startup", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    if said.is_set():  # not after an error: its own message follows
        print(f"{what}: done in {time.monotonic() - start:.1f} s", file=out, flush=True)
