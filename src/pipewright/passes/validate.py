"""The validator: a schedule is accepted only if it can run to completion and computes everything.

Checks, in order, each failure raising :class:`~pipewright.errors.ValidationError` whose first line
names rank, position and action, followed by the text grid with the offending cell bracketed:

1. every action's kind is known, its stage and microbatch are in range, it names a microbatch exactly
   when its kind is per-microbatch (``KindSpec.per_microbatch``), and it runs on the rank that holds its
   stage;
2. no action appears twice and no event is produced twice (e.g. both ``B`` and ``I`` for one microbatch);
3. every completeness rule of the schedule's kinds holds (core: every stage computes F, I and W for
   every microbatch, B counting as I and W; a feature kind's rule applies when the schedule uses the
   kind), every requirement is produced somewhere, every send has its receive, no send/receive crosses
   a local hand-off, and every collective that spans pipeline ranks has one action on each member;
4. executing the ranks in order with blocking receives (sends never block) finishes: an action placed
   before a dependency its own rank produces later is reported as such; otherwise the stuck heads of
   all ranks are reported as a deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from pipewright.deps import Resolution, matching_recv, resolve
from pipewright.errors import ValidationError
from pipewright.ir import Action, Event, Schedule, event_action

_GRID_WIDTH = 24


def _fail(schedule: Schedule, rank: int, pos: int, message: str) -> ValidationError:
    return ValidationError(
        f"{schedule.name}: rank {rank}, position {pos}: {message}",
        schedule.grid(mark=(rank, pos), width=_GRID_WIDTH),
    )


def _fmt(event: Event) -> str:
    return str(event_action(event))


def validate(schedule: Schedule) -> Schedule:
    """Raise ValidationError if ``schedule`` is broken; return it unchanged otherwise."""
    validate_resolved(schedule)
    return schedule


def validate_resolved(schedule: Schedule, resolution: Resolution | None = None) -> Resolution:
    """:func:`validate`, returning the schedule's dependency :class:`~pipewright.deps.Resolution` so a
    caller (the simulator) need not derive it again."""
    res = resolution or resolve(schedule)
    if _looks_valid(schedule, res):
        # the set-level checks passed: only the execution remains; the positions of producers are
        # needed only to explain a failure
        _check_executes(schedule, lambda: _check_structure(schedule, res), res)
        return res
    producer = _check_structure(schedule, res)  # the precise checks name the offending action
    _check_complete(schedule, producer, res)
    _check_executes(schedule, lambda: producer, res)
    return res


def _looks_valid(schedule: Schedule, res: Resolution) -> bool:
    """Checks 1–3 over sets, at C speed per action: True when they all pass (then the per-action
    checks, which exist to name the offending action, can be skipped)."""
    kinds = schedule.kinds
    per_mb = {name: spec.per_microbatch for name, spec in kinds.items()}
    n_stages, n_mb, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    for rank, row in enumerate(schedule.actions):
        if len(set(row)) != len(row) or not {a[1] for a in row} <= per_mb.keys():
            return False
        if any(not 0 <= s < n_stages or placement[s] != rank for s in {a[0] for a in row}):
            return False
        for kind, mb in {(a[1], a[2]) for a in row}:
            needs = per_mb[kind]
            if (mb is not None and not 0 <= mb < n_mb) or (needs is not None and (mb is not None) != needs):
                return False
    produced = res.producer
    if res.duplicate is not None:
        return False  # an event computed twice
    if max(chain.from_iterable(res.needs), default=-1) >= res.missing:
        return False  # a requirement nothing produces
    used = {a[1] for row in schedule.actions for a in row}
    for spec in kinds.values():
        applies = spec.complete is not None and (spec.always or spec.name in used)
        if applies and not all(ev in produced for ev, _ in spec.complete(schedule)):
            return False
    p2p = {name: spec.p2p for name, spec in kinds.items() if spec.p2p is not None}
    for row in schedule.actions:
        pairs = {(a[1], a[0]) for a in row if a[1] in p2p}
        for kind, stage in pairs:
            peer = stage + p2p[kind].offset
            if not 0 <= peer < n_stages or placement[peer] == placement[stage]:
                return False
        sends = {name: (spec.pair, spec.offset) for name, spec in p2p.items() if spec.role == "send"}
        needed = {(sends[a[1]][0], a[0] + sends[a[1]][1], a[2], a[3]) for a in row if a[1] in sends}
        if not all(ev in produced for ev in needed):
            return False
    # pipeline-spanning collectives: their membership and order checks are per action
    return not any(
        kinds[name].collective is not None and kinds[name].collective.spans_pipeline for name in used
    )


def _check_structure(schedule: Schedule, res: Resolution) -> dict[Event, tuple[int, int]]:
    """Per-action checks; returns event → (rank, position) of the action producing it."""
    producer: dict[Event, tuple[int, int]] = {}
    seen: set[Action] = set()
    per_mb = {name: spec.per_microbatch for name, spec in schedule.kinds.items()}
    n_stages, n_mb, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    for rank, row in enumerate(schedule.actions):
        outs = res.produces[rank]
        for pos, a in enumerate(row):
            stage, kind, mb = a[0], a[1], a[2]
            if kind not in per_mb:
                raise _fail(schedule, rank, pos, f"unknown action kind {kind!r} in {a}")
            if not 0 <= stage < n_stages:
                raise _fail(schedule, rank, pos, f"{a} names stage {stage}; stages are 0..{n_stages - 1}")
            if mb is not None and not 0 <= mb < n_mb:
                raise _fail(schedule, rank, pos, f"{a} names microbatch {mb}; microbatches are 0..{n_mb - 1}")
            needs_mb = per_mb[kind]
            if needs_mb is not None and (mb is not None) != needs_mb:
                needs = (
                    "needs a microbatch index" if needs_mb else "runs once per stage, without a microbatch"
                )
                raise _fail(schedule, rank, pos, f"{a}: {kind} {needs}")
            owner = placement[stage]
            if owner != rank:
                raise _fail(
                    schedule,
                    rank,
                    pos,
                    f"{a} runs on rank {rank} but stage {stage} is placed on rank {owner}",
                )
            if a in seen:
                r0, p0 = _position_of(schedule, a)
                raise _fail(schedule, rank, pos, f"{a} is duplicated (also at rank {r0}, position {p0})")
            seen.add(a)
            for ev in outs[pos]:
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


def _position_of(schedule: Schedule, action: Action) -> tuple[int, int]:
    """(rank, position) of the first occurrence of ``action`` (for messages)."""
    for rank, row in enumerate(schedule.actions):
        if action in row:
            return rank, row.index(action)
    return -1, -1


def _check_complete(schedule: Schedule, producer: dict[Event, tuple[int, int]], res: Resolution) -> None:
    kinds = schedule.kinds
    used = {a.kind for row in schedule.actions for a in row}
    for spec in kinds.values():
        if spec.complete is None or not (spec.always or spec.name in used):
            continue
        for ev, via in spec.complete(schedule):
            if ev not in producer:
                action = event_action(ev)
                rank = schedule.placement[action.stage]
                raise _fail(
                    schedule,
                    rank,
                    len(schedule.actions[rank]),
                    f"missing {action}: stage {action.stage} never runs {via}"
                    + (f" for microbatch {action.microbatch}" if action.microbatch is not None else ""),
                )
    with_collective = {name for name, spec in kinds.items() if spec.collective is not None}
    collectives: set[tuple] = {
        (rank, a[1], a[2], a[3])
        for rank, row in enumerate(schedule.actions)
        for a in row
        if a[1] in with_collective
    }
    talks = {name for name, spec in kinds.items() if spec.p2p is not None or spec.collective is not None}
    for rank, row in enumerate(schedule.actions):
        reqs = res.requires[rank]
        for pos, a in enumerate(row):
            for ev in reqs[pos]:
                if ev not in producer:
                    raise _fail(schedule, rank, pos, f"{a} needs {_fmt(ev)}, which no rank runs")
            if a[1] not in talks:
                continue
            spec = kinds[a[1]]
            if spec.p2p is not None:
                _check_p2p(schedule, producer, rank, pos, a)
            elif spec.collective.spans_pipeline:
                _check_collective(schedule, collectives, rank, pos, a)
    _check_collective_order(schedule)


def _check_p2p(
    schedule: Schedule, producer: dict[Event, tuple[int, int]], rank: int, pos: int, a: Action
) -> None:
    p2p = schedule.kinds[a[1]].p2p
    stage = a[0]
    peer = stage + p2p.offset
    if not 0 <= peer < schedule.num_stages:
        where = "past the last stage" if peer >= schedule.num_stages else "before the first stage"
        raise _fail(schedule, rank, pos, f"{a} {'sends' if p2p.role == 'send' else 'receives from'} {where}")
    if schedule.placement[peer] == schedule.placement[stage]:
        verb = "sends between" if p2p.role == "send" else "receives between"
        raise _fail(
            schedule,
            rank,
            pos,
            f"{a} {verb} stages {stage} and {peer}, which share rank {rank}: hand over locally",
        )
    if p2p.role == "send" and (p2p.pair, peer, a[2], a[3]) not in producer:
        raise _fail(schedule, rank, pos, f"unmatched send {a}: no rank runs {matching_recv(a, schedule)}")


def _check_collective(schedule: Schedule, collectives: set[tuple], rank: int, pos: int, a: Action) -> None:
    """A pipeline-spanning collective needs one action with its microbatch and payload on every member."""
    members = schedule.kinds[a.kind].collective.participants(a, schedule)
    if rank not in members:
        raise _fail(
            schedule, rank, pos, f"{a} runs on rank {rank}, which is not in its group {list(members)}"
        )
    for other in members:
        if (other, a.kind, a.microbatch, a.payload) not in collectives:
            raise _fail(
                schedule,
                rank,
                pos,
                f"collective {a} has no counterpart on rank {other} (group {list(members)}): "
                f"every member runs {a.kind} for the same microbatch and payload",
            )


def _check_executes(
    schedule: Schedule, producer_of: Callable[[], dict[Event, tuple[int, int]]], res: Resolution
) -> None:
    rows = schedule.actions
    needs, offsets = res.needs, res.offsets
    # A collective spanning pipeline ranks is issued without blocking its rank; its events complete
    # when the last member has issued it (a rendezvous), as in the simulator.
    rendezvous = _rendezvous_keys(schedule)
    arrived: dict[tuple, list[int]] = {}
    done = bytearray(res.missing + 1)  # done[g]: action g's events happened; the last never does
    check = done.__getitem__
    ptr = [0] * len(rows)
    remaining = len(needs)
    while remaining:
        progress = False
        for rank, row in enumerate(rows):
            p, base, n = ptr[rank], offsets[rank], len(row)
            while p < n and all(map(check, needs[base + p])):
                key = rendezvous.get((rank, p)) if rendezvous else None
                if key is None:
                    done[base + p] = 1
                else:
                    group = arrived.setdefault(key, [])
                    group.append(base + p)
                    if len(group) == len(key[-1]):
                        for g in group:
                            done[g] = 1
                p += 1
            if p != ptr[rank]:
                remaining -= p - ptr[rank]
                ptr[rank] = p
                progress = True
        if not progress:
            break
    if not remaining:
        return
    producer = producer_of()
    stuck = []
    for rank, row in enumerate(rows):
        p = ptr[rank]
        if p >= len(row):
            continue
        missing = [
            ev for ev, g in zip(res.requires[rank][p], needs[offsets[rank] + p], strict=True) if not done[g]
        ]
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


def _rendezvous_keys(schedule: Schedule) -> dict[tuple[int, int], tuple]:
    """(rank, position) of each pipeline-spanning collective → its rendezvous key
    (kind, microbatch, payload, members)."""
    keys: dict[tuple[int, int], tuple] = {}
    spanning = {
        name: spec.collective
        for name, spec in schedule.kinds.items()
        if spec.collective is not None and spec.collective.spans_pipeline
    }
    if not spanning:
        return keys
    for rank, row in enumerate(schedule.actions):
        for pos, a in enumerate(row):
            coll = spanning.get(a[1])
            if coll is not None:
                keys[(rank, pos)] = (a.kind, a.microbatch, a.payload, coll.participants(a, schedule))
    return keys


def _check_collective_order(schedule: Schedule) -> None:
    """Members of one group must issue its collectives in the same order (process groups match
    collectives by order, not by name). A group is its name and its members: two named groups over the
    same ranks are two process groups, each with its own order."""
    sequences: dict[tuple[str, tuple[int, ...]], dict[int, list[tuple[Action, int]]]] = {}
    for (rank, pos), key in _rendezvous_keys(schedule).items():
        a = schedule.actions[rank][pos]
        group = (schedule.kinds[a.kind].collective.group, key[-1])
        sequences.setdefault(group, {}).setdefault(rank, []).append((a, pos))
    for (_, members), by_rank in sequences.items():
        first = min(by_rank)
        ref = [(a.kind, a.microbatch, a.payload) for a, _ in by_rank[first]]
        for rank, seq in sorted(by_rank.items()):
            for i, (a, pos) in enumerate(seq):
                if i >= len(ref) or (a.kind, a.microbatch, a.payload) != ref[i]:
                    expected = f"{ref[i][0]} of microbatch {ref[i][1]}" if i < len(ref) else "nothing"
                    raise _fail(
                        schedule,
                        rank,
                        pos,
                        f"collective {a} is number {i} of group {list(members)} on rank {rank}, but "
                        f"rank {first} issues {expected} there: members must issue collectives in one order",
                    )
