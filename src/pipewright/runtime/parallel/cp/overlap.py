"""DualPipe's F&B overlap in the runtime: the forward of one microbatch runs while the backward of
another computes, so that the communication inside each (the context-parallel ring exchanges, the
mixture-of-experts dispatch and combine all-to-alls, and the pipeline sends of the forward's output)
hides behind the other's compute.

DeepSeek's DualPipe pairs a forward chunk with a backward chunk and runs them on two streams; the
schedule marks those pairs (``Schedule.meta["overlapped_pairs"]``: per rank, the position of each
pair's F in the compute-only order, its B next). :func:`overlap_pairs_wrapper` is a handler wrapper
(:meth:`pipewright.runtime.core.executor.PipelineExecutor.wrap_handlers`) that, for each pair: starts the
F on a second thread, which also posts the F's pipeline sends as soon as the F is done; lets the
executor run the actions up to the B (the B's receives) and the B itself on the main thread; then
waits for the F's thread. Nothing is sent later than in the one-after-the-other order, so the overlap
cannot deadlock a schedule that is valid without it.

The two threads communicate at the same time, so their collectives must not share a process group:
the ring's forward exchanges and its backward exchanges use two groups over the same ranks
(:class:`~pipewright.runtime.parallel.cp.ring.DistRing`), so do the experts' forward and backward all-to-alls
(``ParallelMesh.ep_group`` / ``ep_back_group``; :class:`pipewright.runtime.parallel.moe_parallel.AllToAll`);
each
group then sees its collectives in the same order on every rank (the forwards in F order, the
backwards in B order), as the schedule is the same on every peer. Pairs run one after the other
(no thread) with tensor parallelism (whose collectives share the tp group), with recomputation (a
backward that re-runs a forward would use the forward's groups) and without gradients (validation).

On CUDA the two threads are two streams, as in DualPipe. A new thread's current device is device 0,
so the F's thread first calls ``set_device`` (the executor's device). It launches on a side stream of
its own (one per device, kept), so that a blocking all-to-all or ring wait of one thread — which
stalls its stream — leaves the other's kernels running. Events join the streams at the pair's
boundaries: the side stream waits for an event recorded on the main thread's stream when the pair
starts (the F's inputs, written there, are ready), and the main stream waits for an event recorded on
the side stream when the F is done (its output, and the sends posted after it, come before whatever
the main thread launches after the pair). The tensors the F leaves behind (its output, the saved
activations its B reads) were allocated on the side stream; the caching allocator may hand their
memory back to that stream once freed, so the F's output is marked in use by the main stream
(``record_stream``). The activations its backward frees run on the side stream too (autograd runs a
node's backward on its forward's stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipewright.ir import Action, Schedule


def pair_actions(schedule: Schedule, pp_rank: int) -> dict[Action, tuple[Action, tuple[Action, ...]]]:
    """F → (its paired B, the send actions of the F's outputs) for this rank's overlapped pairs of a
    lowered ``schedule`` (empty when it marks none)."""
    marks = (schedule.meta or {}).get("overlapped_pairs")
    if not marks:
        return {}
    row = schedule.actions[pp_rank]
    kinds = schedule.kinds
    compute = [a for a in row if kinds[a.kind].compute]
    out: dict[Action, tuple[Action, tuple[Action, ...]]] = {}
    for i in marks[pp_rank]:
        if i + 1 >= len(compute):
            continue
        f, b = compute[i], compute[i + 1]
        start = row.index(f)
        sends = []
        for a in row[start + 1 :]:
            if a == b:
                break
            spec = kinds[a.kind]
            if spec.comm == "send" and (a.stage, a.microbatch) == (f.stage, f.microbatch):
                sends.append(a)
        out[f] = (b, tuple(sends))
    return out


class PairOverlap:
    """The handler wrapper's state for one executor (:func:`overlap_pairs_wrapper`)."""

    def __init__(self, pairs: dict[Action, tuple[Action, tuple[Action, ...]]]) -> None:
        self.pairs = pairs
        self.send_of = {s: f for f, (_, sends) in pairs.items() for s in sends}
        self.partner = {b: f for f, (b, _) in pairs.items()}
        self.inner: dict[str, Callable] = {}
        self.running: dict[Action, tuple[threading.Thread, list[BaseException], list]] = {}
        self.pairs_overlapped = 0
        self.side_streams: dict[torch.device, Any] = {}  # CUDA: the F threads' stream, per device

    def wrap(self, kind: str, handler: Callable) -> Callable:
        self.inner[kind] = handler

        def run(state: Any, a: Action) -> None:
            if a in self.pairs and torch.is_grad_enabled():
                self._start(state, a)
            elif self.send_of.get(a) in self.running:
                return  # posted by the F's thread right after the F
            elif a in self.partner and self.partner[a] in self.running:
                try:
                    handler(state, a)
                finally:
                    self._join(self.partner[a], state)
            else:
                handler(state, a)

        return run

    def _start(self, state: Any, f: Action) -> None:
        errors: list[BaseException] = []
        done: list = []  # (the event recorded after the F and its sends — CUDA only —, the device)
        _, sends = self.pairs[f]
        device = torch.device(getattr(state.executor, "device", "cpu"))
        ready = _event_on_current(device)

        def body() -> None:
            try:
                with self._side_stream(device, ready):
                    self.inner[f.kind](state, f)
                    if sends:  # as the executor's send handler, for exactly these (not at its position)
                        sources = state.executor.send_sources
                        state.comm.send([(s, sources[s.kind](state, s)) for s in sends])
                        state.sent.update(sends)
                    done.append((_event_on_current(device), device))
            except BaseException as e:  # re-raised on the main thread by _join
                errors.append(e)

        thread = threading.Thread(target=body, name=f"F&B {f}", daemon=True)
        self.running[f] = (thread, errors, done)
        thread.start()

    @contextmanager
    def _side_stream(self, device: torch.device, ready: Any) -> Iterator[None]:
        """In the F's thread: on CUDA the executor's device current and this device's side stream
        current, after the main stream's ``ready`` event (module docstring); nothing on the CPU."""
        if device.type != "cuda":
            yield
            return
        torch.cuda.set_device(device)
        stream = self.side_streams.get(device)
        if stream is None:
            stream = self.side_streams[device] = torch.cuda.Stream(device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            yield

    def _join(self, f: Action, state: Any = None) -> None:
        thread, errors, done = self.running.pop(f)
        thread.join()
        self.pairs_overlapped += 1
        if errors:
            raise errors[0]
        event, device = done[0] if done else (None, None)
        if event is not None:  # CUDA: what the main thread launches next comes after the F and its sends
            main = torch.cuda.current_stream(device)
            main.wait_event(event)
            out = getattr(state, "stage_outputs", {}).get((f.stage, f.microbatch)) if state else None
            if isinstance(out, torch.Tensor):
                out.record_stream(main)


def _event_on_current(device: torch.device) -> Any:
    """On CUDA an event recorded on ``device``'s current stream (of the calling thread); None on the
    CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def install_pair_overlap(executor: Any, config: Any, mesh: Any) -> PairOverlap | None:
    """Overlap ``executor``'s F&B pairs (module docstring) and return the wrapper; None — pairs one
    after the other — with ``config.blocking_pairs``, tensor parallelism, recomputation, or a
    schedule that marks no pairs."""
    if config.blocking_pairs or mesh.tp > 1 or config.recompute != "none":
        return None
    wrapper = overlap_pairs_wrapper(executor.schedule, mesh.pp_rank)
    if wrapper is not None:
        executor.wrap_handlers(wrapper.wrap)
    return wrapper


def overlap_pairs_wrapper(schedule: Schedule, pp_rank: int) -> PairOverlap | None:
    """The wrapper for this rank of a lowered ``schedule`` (None when it marks no F&B pairs); pass
    its :meth:`PairOverlap.wrap` to ``PipelineExecutor.wrap_handlers``."""
    pairs = pair_actions(schedule, pp_rank)
    return PairOverlap(pairs) if pairs else None
