"""The validator: a schedule is accepted only if it can run to completion and computes everything.

Checks, in order, each failure raising :class:`~pipewright.errors.ValidationError` whose first line
names rank, position and action, followed by the text grid with the offending cell bracketed:

1. every action's kind is known, its stage and microbatch are in range, it names a microbatch exactly
   when its kind is per-microbatch (``KindSpec.per_microbatch``), and it runs on the rank that holds its
   stage;
2. no action appears twice and no event is produced twice (e.g. both ``B`` and ``I`` for one microbatch);
3. every stage computes F, I and W for every microbatch (B counts as I and W), every requirement is
   produced somewhere, every send has its receive and no send/receive crosses a local hand-off;
4. executing the ranks in order with blocking receives (sends never block) finishes: an action placed
   before a dependency its own rank produces later is reported as such; otherwise the stuck heads of
   all ranks are reported as a deadlock.
"""

from __future__ import annotations

from pipewright.deps import SEND_TO_RECV, matching_recv, produces, requires
from pipewright.errors import ValidationError
from pipewright.ir import Action, Event, F, I, Schedule, W

_GRID_WIDTH = 24


def _fail(schedule: Schedule, rank: int, pos: int, message: str) -> ValidationError:
    return ValidationError(
        f"{schedule.name}: rank {rank}, position {pos}: {message}",
        schedule.grid(mark=(rank, pos), width=_GRID_WIDTH),
    )


def _fmt(event: Event) -> str:
    return str(Action(event[1], event[0], event[2]))


def validate(schedule: Schedule) -> Schedule:
    """Raise ValidationError if ``schedule`` is broken; return it unchanged otherwise."""
    producer = _check_structure(schedule)
    _check_complete(schedule, producer)
    _check_executes(schedule, producer)
    return schedule


def _check_structure(schedule: Schedule) -> dict[Event, tuple[int, int]]:
    """Per-action checks; returns event → (rank, position) of the action producing it."""
    producer: dict[Event, tuple[int, int]] = {}
    seen: dict[Action, tuple[int, int]] = {}
    kinds = schedule.kinds
    for rank, row in enumerate(schedule.actions):
        for pos, a in enumerate(row):
            if a.kind not in kinds:
                raise _fail(schedule, rank, pos, f"unknown action kind {a.kind!r} in {a}")
            if not 0 <= a.stage < schedule.num_stages:
                raise _fail(
                    schedule,
                    rank,
                    pos,
                    f"{a} names stage {a.stage}; stages are 0..{schedule.num_stages - 1}",
                )
            if a.microbatch is not None and not 0 <= a.microbatch < schedule.num_microbatches:
                raise _fail(
                    schedule,
                    rank,
                    pos,
                    f"{a} names microbatch {a.microbatch}; "
                    f"microbatches are 0..{schedule.num_microbatches - 1}",
                )
            per_microbatch = kinds[a.kind].per_microbatch
            if per_microbatch is not None and (a.microbatch is not None) != per_microbatch:
                needs = (
                    "needs a microbatch index"
                    if per_microbatch
                    else "runs once per stage, without a microbatch"
                )
                raise _fail(schedule, rank, pos, f"{a}: {a.kind} {needs}")
            owner = schedule.placement[a.stage]
            if owner != rank:
                raise _fail(
                    schedule,
                    rank,
                    pos,
                    f"{a} runs on rank {rank} but stage {a.stage} is placed on rank {owner}",
                )
            if a in seen:
                r0, p0 = seen[a]
                raise _fail(schedule, rank, pos, f"{a} is duplicated (also at rank {r0}, position {p0})")
            seen[a] = (rank, pos)
            for ev in produces(a, schedule):
                if ev in producer:
                    r0, p0 = producer[ev]
                    raise _fail(
                        schedule,
                        rank,
                        pos,
                        f"{a} computes {_fmt(ev)} a second time (already at rank {r0}, position {p0})",
                    )
                producer[ev] = (rank, pos)
    return producer


def _check_complete(schedule: Schedule, producer: dict[Event, tuple[int, int]]) -> None:
    for s in range(schedule.num_stages):
        rank = schedule.placement[s]
        for k in range(schedule.num_microbatches):
            for kind, via in ((F, "F"), (I, "B or I"), (W, "B or W")):
                if (kind, s, k) not in producer:
                    pos = len(schedule.actions[rank])
                    raise _fail(
                        schedule,
                        rank,
                        pos,
                        f"missing {Action(s, kind, k)}: stage {s} never runs {via} for microbatch {k}",
                    )
    for rank, row in enumerate(schedule.actions):
        for pos, a in enumerate(row):
            for ev in requires(a, schedule):
                if ev not in producer:
                    raise _fail(schedule, rank, pos, f"{a} needs {_fmt(ev)}, which no rank runs")
            if a.kind in SEND_TO_RECV:
                recv = matching_recv(a)
                if not 0 <= recv.stage < schedule.num_stages:
                    raise _fail(schedule, rank, pos, f"{a} sends past the last stage")
                if schedule.local(a.stage, recv.stage):
                    raise _fail(
                        schedule,
                        rank,
                        pos,
                        f"{a} sends between stages {a.stage} and "
                        f"{recv.stage}, which share rank {rank}: hand over locally",
                    )
                if (recv.kind, recv.stage, recv.microbatch) not in producer:
                    raise _fail(schedule, rank, pos, f"unmatched send {a}: no rank runs {recv}")
            if schedule.kinds[a.kind].comm == "recv":
                # a receive across a local boundary is as wrong as the send
                src = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
                if 0 <= src < schedule.num_stages and schedule.local(a.stage, src):
                    raise _fail(
                        schedule,
                        rank,
                        pos,
                        f"{a} receives from stage {src} on the same rank: hand over locally",
                    )


def _check_executes(schedule: Schedule, producer: dict[Event, tuple[int, int]]) -> None:
    rows = schedule.actions
    reqs = [[requires(a, schedule) for a in row] for row in rows]
    outs = [[produces(a, schedule) for a in row] for row in rows]
    ptr = [0] * len(rows)
    done: set[Event] = set()
    remaining = sum(len(r) for r in rows)
    while remaining:
        progress = False
        for rank, row in enumerate(rows):
            p = ptr[rank]
            rr, oo = reqs[rank], outs[rank]
            while p < len(row) and all(ev in done for ev in rr[p]):
                done.update(oo[p])
                p += 1
            if p != ptr[rank]:
                remaining -= p - ptr[rank]
                ptr[rank] = p
                progress = True
        if not progress:
            break
    if not remaining:
        return
    stuck = []
    for rank, row in enumerate(rows):
        p = ptr[rank]
        if p >= len(row):
            continue
        missing = [ev for ev in reqs[rank][p] if ev not in done]
        for ev in missing:
            r0, p0 = producer[ev]
            if r0 == rank and p0 > p:
                raise _fail(
                    schedule,
                    rank,
                    p,
                    f"{row[p]} runs before its dependency {_fmt(ev)} (position {p0} of the same rank)",
                )
        stuck.append((rank, p, row[p], missing))
    rank, p, _, _ = stuck[0]
    waits = "; ".join(
        f"rank {r} at position {q} runs {a} waiting for "
        + ", ".join(f"{_fmt(ev)} (rank {producer[ev][0]})" for ev in miss)
        for r, q, a, miss in stuck
    )
    raise _fail(schedule, rank, p, f"deadlock with blocking receives: {waits}")
