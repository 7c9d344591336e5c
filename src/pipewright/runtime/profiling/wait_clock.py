"""Seconds spent waiting on communication, per direction, measured where the wait happens.

On the CPU (gloo) a wait blocks the host: its wall time is the wait. On CUDA, NCCL's ``Work.wait()``
and a synchronous collective return to the host at once — they only make the current stream wait —
so host time would measure enqueueing. :class:`WaitClock` there records a CUDA event on the current
stream before and after the wait; their gap is how long the stream stood still for the communication.
The gaps are read when the clock is read (after the step), so timing adds no host synchronisation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class WaitClock(dict):
    """{False: forward seconds, True: backward seconds} (a dict, read and reset as one); add to it with
    :meth:`timing`. Safe to add from the two threads of an overlapped F&B pair."""

    def __init__(self) -> None:
        super().__init__({False: 0.0, True: 0.0})
        self._pending: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()

    @contextmanager
    def timing(self, backward: bool, device: torch.device) -> Iterator[None]:
        """Time the wait inside: host wall time on the CPU, the current stream's gap on CUDA."""
        if device.type != "cuda":
            start = time.perf_counter()
            yield
            with self._lock:
                self._add(backward, time.perf_counter() - start)
            return
        stream = torch.cuda.current_stream(device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        yield
        after.record(stream)
        with self._lock:
            self._pending.append((backward, before, after))

    def _settle(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            for backward, before, after in pending:
                after.synchronize()
                self._add(backward, before.elapsed_time(after) / 1e3)

    def _add(self, backward: bool, seconds: float) -> None:
        dict.__setitem__(self, backward, dict.__getitem__(self, backward) + seconds)

    def __getitem__(self, backward: bool) -> float:
        self._settle()
        return dict.__getitem__(self, backward)

    def values(self):  # type: ignore[override]
        self._settle()
        return dict.values(self)

    def items(self):  # type: ignore[override]
        self._settle()
        return dict.items(self)
