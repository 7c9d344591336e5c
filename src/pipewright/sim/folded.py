"""The simulator's compute-level compile: a schedule of compute actions compiled straight to the folded
compute-only loop (:mod:`pipewright.sim.steps`, free transfers), without building its lowered actions.

Lowering (:func:`pipewright.passes.lower.lower`) puts a receive right before and a send right after each
compute action of a kind they attach to whose peer stage sits on another rank. When every send lasts 0,
the compute-only loop takes one event per compute action: a requirement on a send is one on the compute
action it follows, and a receive's wait for its send belongs to the compute action it precedes. So the
loop's inputs follow from the compute actions alone, with each transfer a *virtual* action — its kind,
the compute action (step) it sits next to, its stage and microbatch:

- an event of a compute kind is produced by its compute action, of a send kind by the send after step
  g, of a receive kind by the receive before step g (one table of producers over all of them, keyed as
  in :mod:`pipewright.sim.codes`);
- a compute action waits for the producers of its requirements, except compute actions of its own rank
  that come earlier (program order awaits them) and receives before it or before an earlier action;
- the compute action after a receive waits for the step of that receive's send; a send's requirement
  is an earlier (or its own) compute action of its rank;
- links, the sends' destinations (the rank of the receive that needs it) and transfer times are those
  of :mod:`pipewright.sim.flat`, of the same sends in the same program order.

Anything else declines (:class:`pipewright.sim.codes._Decline`) and the lowered array path decides: a
schedule that is lowered or holds other than compute kinds, a rule that is a plain function, a
requirement on a send, on a later receive or on another rank's receive, a receive with other than one
requirement, a send that lasts longer than 0, a negative duration, two transfer kinds after one action.
What runs is bit-for-bit what the lowered path runs: the same maxima and sums over the same numbers.
The lowered program (its list of actions, for timelines and per-action times) is compiled on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from pipewright.sim.codes import (
    INDEX,
    MAX_KEYS,
    _Codes,
    _columns,
    _compute_costs,
    _Decline,
    _repeats,
    attached,
    transfer_links,
)
from pipewright.sim.program import one_or_several
from pipewright.sim.steps import Folded, FoldedSteps, link_lasts

if TYPE_CHECKING:
    from collections.abc import Callable

    from pipewright.cost.base import CommModel, CostModel
    from pipewright.deps import Term
    from pipewright.ir import Schedule
    from pipewright.kinds import KindSpec
    from pipewright.sim.program import _Program

# Who produces an event: a compute action, the send after one, the receive before one.
_BY_COMPUTE, _BY_SEND, _BY_RECV = 0, 1, 2


class _Lowered:
    """The lowered program, compiled on first use (``make()``), shared by the program and its steps."""

    def __init__(self, make: Callable[[], _Program]) -> None:
        self._make = make

    @cached_property
    def program(self) -> _Program:
        prog = self._make()
        if prog.steps is None:  # the conditions here imply the lowered path's; a mismatch is a bug
            raise RuntimeError("the lowered program of a folded schedule has no compute-only form")
        return prog


@dataclass(frozen=True)
class FoldedProgram:
    """What :func:`pipewright.sim.engine.simulate` reads of a compiled program, from the compute actions:
    the lowered offsets and action count, links, busy time, FLOPs and memory, and the folded steps. Any
    other attribute (modes, durations, requirements of every lowered action; :attr:`listed`) is the
    lowered program's, compiled on first use."""

    offsets: list[int]
    missing: int
    num_links: int
    busy: list[float]
    flops: float
    model_flops: float
    peak_memory: list[float]
    steps: FoldedSteps
    lowered: _Lowered

    @property
    def meets(self) -> dict:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "lowered":
            raise AttributeError(name)
        return getattr(self.lowered.program, name)


def compile_folded(
    schedule: Schedule, cost: CostModel, comm: CommModel, check: bool, lowered: Callable[[], _Program]
) -> FoldedProgram:
    """The :class:`FoldedProgram` of ``schedule`` (see the module docstring), or :class:`_Decline`.
    ``check``: the validator's completeness check (the transfers are right by construction; a send
    without its receive declines). ``lowered()``: the lowered program, asked on first use."""
    codes = _Codes(schedule)
    specs, S = codes.specs, codes.S
    if schedule.lowered:
        raise _Decline
    kc, st, mb, rank, lens = _columns(schedule, codes)
    n = len(kc)
    used = np.flatnonzero(np.bincount(kc, minlength=len(specs))).tolist()
    if not all(specs[c].compute for c in used):
        raise _Decline
    n_keys = len(specs) * S * (codes.M + 1)
    if n_keys > MAX_KEYS or _repeats(codes.key(kc, st, mb), n_keys):
        raise _Decline
    transfers = attached(codes, kc, st)
    # each transfer kind's actions: the steps they sit next to
    at = {c: np.flatnonzero(mask) for c, _, mask in transfers}
    if any(_rule(specs[c].produces, specs[c]) is not None for c in at):
        raise _Decline  # a transfer that produces other than its own event
    # the table of producers: step and role of each event
    prod_g, prod_k = [], []
    for c in used:
        g = np.flatnonzero(kc == c)
        terms = _rule(specs[c].produces, specs[c])
        if terms is None:
            prod_g.append(g)
            prod_k.append(codes.key(c, st[g], mb[g]))
            continue
        for t in terms:
            if t.offset != 0:
                raise _Decline
            prod_g.append(g)
            prod_k.append(codes.key(codes.kind(t.kind), st[g], mb[g]))
    roles = np.zeros(len(specs), np.int8)
    for c, spec, _ in transfers:
        roles[c] = _BY_SEND if spec.p2p.role == "send" else _BY_RECV
        prod_g.append(at[c])
        prod_k.append(codes.key(c, st[at[c]], mb[at[c]]))
    pk = np.concatenate(prod_k)
    if _repeats(pk, n_keys):
        raise _Decline  # an event computed twice
    producer = np.full(n_keys, -1, INDEX)
    producer[pk] = np.concatenate(prod_g)
    width = S * (codes.M + 1)
    if check:
        _check_complete(codes, producer, used)

    def resolve(c: int, g):
        """(consumer steps, producer steps, producer roles) of the requirements of kind c's actions g."""
        terms = _rule(specs[c].requires, specs[c])
        if terms is None:
            raise _Decline  # an action that requires its own event
        parts = [codes.term(t, g, st[g], mb[g]) for t in terms]
        if not parts:
            return g[:0], g[:0], np.zeros(0, np.int8), 0
        rg = np.concatenate([p[0] for p in parts])
        keys = np.concatenate([p[1] for p in parts])
        need = producer[keys]
        if (need < 0).any():
            raise _Decline  # a requirement nothing produces
        return rg, need, roles[keys // width], len(terms)

    keys_in, events_in = [], []
    for c in used:  # compute actions
        rg, need, role, _ = resolve(c, np.flatnonzero(kc == c))
        own = rank[need] == rank[rg]
        if (role == _BY_SEND).any() or ((role == _BY_RECV) & ((need > rg) | ~own)).any():
            raise _Decline
        keep = (role == _BY_COMPUTE) & ~(own & (need < rg))
        keys_in.append(rg[keep])
        events_in.append(need[keep])
    send_at = np.full(n, -1, INDEX)  # the send kind after each step (−1: none)
    dest = np.full(n, -1, INDEX)  # its destination: the rank of the receive that needs it
    for c, spec, _ in transfers:
        g = at[c]
        rg, need, role, count = resolve(c, g)
        if spec.p2p.role == "recv":
            if count != 1 or (role != _BY_SEND).any() or (rank[need] == rank[rg]).any():
                raise _Decline
            keys_in.append(rg)
            events_in.append(need)
            if _repeats(need, n):
                raise _Decline  # a send that two receives wait for
            dest[need] = rank[rg]
        else:
            if (role != _BY_COMPUTE).any() or (rank[need] != rank[rg]).any() or (need > rg).any():
                raise _Decline
            if (send_at[g] >= 0).any():
                raise _Decline  # two transfer kinds after one action
            send_at[g] = c
            if check:
                peer = st[g] + spec.p2p.offset
                if (producer[codes.key(codes.kind(spec.p2p.pair), peer, mb[g])] < 0).any():
                    raise _Decline  # a send without its receive
    sends = np.flatnonzero(send_at >= 0)  # in program order
    links, num_links, times = transfer_links(
        codes, schedule, cost, comm, send_at[sends], st[sends], mb[sends], rank[sends], dest[sends]
    )
    if times.any():
        raise _Decline  # transfers that take time: the lowered path's loop
    cuts = [0, *np.cumsum(lens).tolist()]
    durs, busy, flops, model_flops, peaks = _compute_costs(
        codes, schedule, cost, kc, st, mb, rank, np.zeros(n, np.int8), cuts
    )
    if (durs < 0).any():
        raise _Decline
    in1, in_extra = one_or_several(np.concatenate(keys_in), np.concatenate(events_in), n)
    src, last = link_lasts(links, sends, lambda first: rank[sends[first]])
    later = _Lowered(lowered)
    steps = FoldedSteps(cuts, durs, Folded(in1, in_extra, src, last), later)
    per_rank = lens + sum(np.bincount(rank[g], minlength=len(lens)) for g in at.values())
    return FoldedProgram(
        [0, *np.cumsum(per_rank).tolist()], int(per_rank.sum()), num_links, busy, flops, model_flops,
        peaks, steps, later,
    )  # fmt: skip


def _rule(rule, spec: KindSpec) -> tuple[Term, ...] | None:
    """The terms of kind ``spec``'s ``rule`` written as data, None for the default (its own event); a
    plain function declines."""
    if rule is None:
        return None
    template = getattr(rule, "template", None)
    if template is None:
        raise _Decline
    return template(spec)


def _check_complete(codes: _Codes, producer, used: list[int]) -> None:
    """The validator's completeness check: every (stage, microbatch) has the event a rule covers."""
    width = codes.S * (codes.M + 1)
    for c, spec in enumerate(codes.specs):
        if spec.complete is None or not (spec.always or c in used):
            continue
        covers = getattr(spec.complete, "covers", None)
        if covers is None:
            raise _Decline
        kind = codes.kind(covers())
        block = producer[kind * width : (kind + 1) * width].reshape(codes.S, codes.M + 1)[:, 1:]
        if (block < 0).any():
            raise _Decline
