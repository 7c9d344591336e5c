"""DualPipe's F&B overlap in the runtime: the forward of one microbatch runs while the backward of
another computes, so that the communication inside each (the context-parallel ring exchanges, the
mixture-of-experts dispatch and combine all-to-alls, and the pipeline sends of the forward's output)
hides behind the other's compute.

DeepSeek's DualPipe pairs a forward chunk with a backward chunk and runs them on two streams; the
schedule marks those pairs (``Schedule.meta["overlapped_pairs"]``: per rank, the position of each
pair's F in the compute-only order, its B next). :func:`overlap_pairs_wrapper` is a handler wrapper
(:meth:`pipewright.runtime.executor.PipelineExecutor.wrap_handlers`) that, for each pair: starts the
F on a second thread, which also posts the F's pipeline sends as soon as the F is done; lets the
executor run the actions up to the B (the B's receives) and the B itself on the main thread; then
waits for the F's thread. Nothing is sent later than in the one-after-the-other order, so the overlap
cannot deadlock a schedule that is valid without it.

The two threads communicate at the same time, so their collectives must not share a process group:
the ring's forward exchanges and its backward exchanges use two groups over the same ranks
(:class:`~pipewright.runtime.cp.ring.DistRing`), so do the experts' forward and backward all-to-alls
(``ParallelMesh.ep_group`` / ``ep_back_group``; :class:`pipewright.runtime.moe.AllToAll`); each
group then sees its collectives in the same order on every rank (the forwards in F order, the
backwards in B order), as the schedule is the same on every peer. Pairs run one after the other
(no thread) with tensor parallelism (whose collectives share the tp group), with recomputation (a
backward that re-runs a forward would use the forward's groups) and without gradients (validation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
        self.running: dict[Action, tuple[threading.Thread, list[BaseException]]] = {}
        self.pairs_overlapped = 0

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
                    self._join(self.partner[a])
            else:
                handler(state, a)

        return run

    def _start(self, state: Any, f: Action) -> None:
        errors: list[BaseException] = []
        _, sends = self.pairs[f]

        def body() -> None:
            try:
                self.inner[f.kind](state, f)
                if sends:  # as the executor's send handler, for exactly these (not at its position)
                    sources = state.executor.send_sources
                    state.comm.send([(s, sources[s.kind](state, s)) for s in sends])
                    state.sent.update(sends)
            except BaseException as e:  # re-raised on the main thread by _join
                errors.append(e)

        thread = threading.Thread(target=body, name=f"F&B {f}", daemon=True)
        self.running[f] = (thread, errors)
        thread.start()

    def _join(self, f: Action) -> None:
        thread, errors = self.running.pop(f)
        thread.join()
        self.pairs_overlapped += 1
        if errors:
            raise errors[0]


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
