"""DualPipeV's F&B pair threads on CUDA (runtime/parallel/cp/overlap.py), and the communication wait clocks,
checked on the CPU against a recording stand-in for ``torch.cuda``: the F's thread sets the
executor's device and launches on a side stream of its own, joined to the main stream by events at
the pair's boundaries; a wait on CUDA is timed by events on the stream, not by the host's enqueue."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from pipewright.ir import Action, B, F
from pipewright.runtime.parallel.cp.overlap import PairOverlap
from pipewright.runtime.parallel.cp.ring import DistRing
from pipewright.runtime.profiling.wait_clock import WaitClock

DEVICE = torch.device("cuda", 1)


class _Cuda:
    """Streams, events and the current device per thread, every call logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.local = threading.local()
        self.main = self.Stream(DEVICE, name="main")
        self.events = 0

    def Stream(self, device, name="side"):
        cuda = self

        class Stream:
            def wait_event(self, event) -> None:
                cuda.log.append(("wait", self.name, event.name))

        stream = Stream()
        stream.name = name
        return stream

    def Event(self, enable_timing: bool = False):
        cuda = self
        self.events += 1

        class Event:
            name = f"e{self.events}"

            def record(self, stream) -> None:
                cuda.log.append(("record", stream.name, self.name))

            def synchronize(self) -> None: ...

            def elapsed_time(self, other) -> float:
                return 250.0  # milliseconds

        return Event()

    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.main)

    @contextmanager
    def stream(self, s):
        before = self.current_stream()
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = before

    def set_device(self, device) -> None:
        self.local.device = device
        self.log.append(("set_device", threading.current_thread().name, device))


@pytest.fixture
def cuda(monkeypatch) -> _Cuda:
    fake = _Cuda()
    for name in ("Stream", "Event", "current_stream", "stream", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_pair_thread_sets_the_device_and_runs_on_its_own_stream_joined_by_events(cuda) -> None:
    f, b = Action(0, F, 1), Action(1, B, 0)
    pairs = PairOverlap({f: (b, ())})

    def handler(state, a) -> None:
        thread = threading.current_thread()
        where = getattr(cuda.local, "device", None) if thread is not threading.main_thread() else "main"
        cuda.log.append((a.kind, where, cuda.current_stream().name))

    state = SimpleNamespace(executor=SimpleNamespace(device=DEVICE), stage_outputs={})
    run_f, run_b = pairs.wrap(F, handler), pairs.wrap(B, handler)
    run_f(state, f)
    run_b(state, b)
    assert pairs.pairs_overlapped == 1
    log = cuda.log
    f_at = log.index((F, DEVICE, "side"))  # the F on the executor's device, on the side stream
    assert (B, "main", "main") in log
    ready = next(e for op, s, e in log[:f_at] if op == "record" and s == "main")
    assert log.index(("wait", "side", ready)) < f_at  # after what the main stream had launched
    assert any(op == "set_device" and d == DEVICE for op, _, d in log[:f_at])
    done = next(e for op, s, e in log[f_at:] if op == "record" and s == "side")
    assert ("wait", "main", done) in log[f_at:]  # the main stream goes on after the F


def test_a_wait_on_cuda_is_timed_on_the_stream_not_the_host(cuda) -> None:
    """Work.wait() on NCCL returns at once (it orders the stream): the clock records events around
    it and reads their gap (here 250 ms) once read, after the step."""
    clock = WaitClock()
    with clock.timing(True, DEVICE):
        pass
    assert [op for op, *_ in cuda.log] == ["record", "record"]
    assert clock[True] == pytest.approx(0.25) and clock[False] == 0.0
    with clock.timing(False, torch.device("cpu")):  # gloo's wait blocks the host: its wall time
        time.sleep(0.01)
    assert clock[False] >= 0.01
    ring = DistRing(None, 0, 2, 1, 1)
    assert isinstance(ring.waited, WaitClock)
