"""V-shape schedules: two model chunks per rank on the V placement (rank r holds stages r and 2p − 1 − r,
so rank 0 holds the first and the last stage and the turn of the V at rank p − 1 hands over locally).

Sources: ZB-V from Qi et al., Zero Bubble Pipeline Parallelism (ICLR 2024, §6); V-Half and V-Min from
Qi et al., Pipeline Parallelism with Controllable Memory (NeurIPS 2024); DualPipeV from DeepSeek's
DualPipe repository (the "cut-in-half" DualPipe of DeepSeek-V3, arXiv 2412.19437).

Units. Every action here works on one chunk (half of a rank's layers). Memory is
:func:`pipewright.ir.peak_in_flight`, in microbatches of a whole rank's layers: F of a chunk adds ½,
W (or B) of that chunk frees it, I frees nothing. 1F1B on the same p ranks peaks at p on rank 0.
Times in docstrings are for T_F = T_I = T_W = 1 per chunk action (B = 2), free communication.

Write c0 = stage r (the descending leg of the V) and c1 = stage 2p − 1 − r (the ascending leg) of
rank r; F0/I0/W0 act on c0, F1/I1/W1 on c1.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from pipewright.errors import ScheduleError
from pipewright.ir import Action, B, F, I, Schedule, W, peak_in_flight, v_placement
from pipewright.schedules.estimate import order_makespan
from pipewright.schedules.schedule_info import ScheduleCosts, ScheduleInfo
from pipewright.schedules.v_greedy import candidates
from pipewright.schedules.vsqueeze import F0, F1, I0, I1, WW, squeeze


def _schedule(name: str, p: int, m: int, rows: list[list[Action]], **meta: object) -> Schedule:
    return Schedule.build(name, m, rows, v_placement(p), **meta)


class _RankOrder:
    """Builds one rank's order, numbering each (stage, kind) stream's microbatches 0, 1, 2, ...

    ``run(stage, kind)`` appends the next microbatch of that stream; B and I share one counter (both
    are "the backward to the input"). Actions for microbatches ≥ ``m`` are dropped, so a pattern written
    for more microbatches than the iteration has shrinks to it (torch's ZBV does the same).
    """

    def __init__(self, m: int) -> None:
        self.m = m
        self.count: Counter[tuple[int, str]] = Counter()
        self.pending_w: deque[tuple[int, int]] = deque()
        self.order: list[Action] = []
        self.pairs: list[int] = []

    def run(self, stage: int, kind: str) -> None:
        key = (stage, I if kind == B else kind)
        k = self.count[key]
        self.count[key] += 1
        if kind == I:
            self.pending_w.append((stage, k))
        if k < self.m:
            self.order.append(Action(stage, kind, k))

    def next_w(self) -> None:
        """The oldest pending W (a no-op when none is pending)."""
        if self.pending_w:
            stage, k = self.pending_w.popleft()
            if k < self.m:
                self.order.append(Action(stage, W, k))

    def overlap(self, fwd_stage: int, bwd_stage: int) -> None:
        """DualPipeV's F&B: the next F of ``fwd_stage`` and the next B of ``bwd_stage``, back to back;
        the position of the F is recorded in ``pairs``."""
        self.pairs.append(len(self.order))
        self.run(fwd_stage, F)
        self.run(bwd_stage, B)

    def done(self, stage: int, kind: str) -> int:
        return self.count[(stage, I if kind == B else kind)]


def zbv_torch(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V as PyTorch hardcodes it (``zbv-torch``; torch's ScheduleZBVZeroBubble builds the same order):
    the order for T_F = T_I = T_W and free communication, whatever the costs.

    Rank r, written for n = max(m, 2p − 1) microbatches (those ≥ m are then dropped):

    1. warm-up: 2(p − r) − 1 × F0; r × (F1, F0); p − r × (F1, I1, W1);
    2. steady: (F0 while any is left), I0, W0, F1, I1, W1 — until every F is done;
    3. cool-down: r × (I0, I1); p − r × (I0, W0); then the W1 and the W0 still pending.

    Valid for every m ≥ 1. Memory (exact, this code): min(2p, m + 1 + r, 2m) chunk-microbatches on rank
    r, i.e. p microbatches of a rank's layers on every rank once m ≥ 2p − 1 — 1F1B's peak (the paper's
    "same memory as 1F1B"). With T_F = T_I = T_W = 1 per chunk one iteration takes 6m + p − 1 for
    m ≥ 2p − 1, and iterations without an optimizer barrier follow every 6m: zero bubble in steady state
    (the paper's claim; 1F1B on the same layers: bubble 6(p − 1)).
    """
    n = max(m, 2 * p - 1)
    rows = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        o = _RankOrder(m)
        for _ in range(2 * (p - r) - 1):
            o.run(c0, F)
        for _ in range(r):
            o.run(c1, F)
            o.run(c0, F)
        for _ in range(p - r):
            o.run(c1, F)
            o.run(c1, I)
            o.next_w()
        while o.done(c1, F) < o.done(c0, F) or o.done(c0, F) < n:
            if o.done(c0, F) < n:
                o.run(c0, F)
            o.run(c0, I)
            o.next_w()
            o.run(c1, F)
            o.run(c1, I)
            o.next_w()
        for _ in range(r):
            o.run(c0, I)
            o.run(c1, I)
        for _ in range(p - r):
            o.run(c0, I)
            o.next_w()
        while o.pending_w:
            o.next_w()
        rows.append(o.order)
    return _schedule("zbv-torch", p, m, rows)


def zbv_costed(p: int, m: int, v: int, costs: ScheduleCosts) -> Schedule:
    """ZB-V as Qi et al. build it: the cost-aware greedy of :mod:`pipewright.schedules.v_greedy` with the
    per-stage F, I, W times and transfer time of ``costs``, at most ``costs.memory_limit`` microbatches of
    a rank's layers in flight (default p, 1F1B's). Of the greedy's candidates and PyTorch's order
    (:func:`zbv_torch`, when it fits the limit) the one with the least
    :func:`~pipewright.schedules.estimate.order_makespan` is kept (ties: the greedy's first);
    ``meta["estimated_makespan"]`` is that estimate."""
    limit = 2 * math.floor(p if costs.memory_limit is None else costs.memory_limit)
    if limit < 2:
        raise ScheduleError(f"zbv: memory_limit {costs.memory_limit} holds no microbatch; give at least 1")
    placement = v_placement(p)
    options = candidates(p, m, costs, limit)
    handmade = zbv_torch(p, m)
    if max(peak_in_flight(handmade)) * 2 <= limit:
        options.append([list(row) for row in handmade.actions])
    if not options:
        raise ScheduleError(f"zbv: no order for p={p}, m={m} within memory_limit {costs.memory_limit}")
    scored = [(order_makespan(rows, placement, costs), n) for n, rows in enumerate(options)]
    best, n = min(scored)
    return _schedule("zbv", p, m, options[n], estimated_makespan=best)


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V with unit costs (T_F = T_I = T_W = 1 per chunk, free communication, memory limit p):
    :func:`zbv_costed`. From p ≥ 2 and m ≥ 2p − 1 one iteration takes 6m + p − 1 at 1F1B's peak p on
    every rank, as PyTorch's order; with fewer microbatches it is faster (p = 8, m = 8: 55 against 62)."""
    unit = (1.0,) * (2 * p)
    return zbv_costed(p, m, v, ScheduleCosts(unit, unit, unit))


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe repository, ``dualpipev.py``; torch's ScheduleDualPipeV).

    DeepSeek overlaps the forward of one chunk with the full backward of the other ("F&B"): the pair
    runs on two streams so the communication of one hides behind the compute of the other. Here an
    F&B pair is written as its two actions back to back, F first (``meta["overlapped_pairs"]`` lists the
    positions of each pair's F in the compute-only order, so a runtime or simulator can overlap them).
    Rank r:

    1. 2(p − r − 1) × F0
    2. r + 1 × (F0, F1)
    3. p − r − 1 × (I1, W, F1)                        zero-bubble steps
    4. m − 2p + r + 1 × (F0&B1, F1&B0)               the main step (rank p − 1's first F0, B1 not
                                                       overlapped)
    5. p − r − 1 × (B1, F1&B0)
    6. r + 1 × (B1, B0), switching to I from the middle on (odd r: at I1, even r: at I0)
    7. p − r − 1 × (W, B0 or I0)
    8. r + 1 × W                                       the pending W, oldest first

    Needs m ≥ 2p (DeepSeek's and torch's requirement). DeepSeek's bubble with P = 2p stages:
    (P/2 − 1)(F&B + B − 3W) = (p − 1)(F&B + B − 3W). Memory (exact, this code): 2p + 1
    chunk-microbatches on every rank, DeepSeek's "PP + 1" activation (PP = 2p stages), i.e. p + ½
    microbatches of a rank's layers. With each pair run one after the other and unit costs (B = 2) one
    iteration takes 6m + p − 1.
    """
    rows, pairs = [], []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        o = _RankOrder(m)
        for _ in range(2 * (p - r - 1)):
            o.run(c0, F)
        for _ in range(r + 1):
            o.run(c0, F)
            o.run(c1, F)
        for _ in range(p - r - 1):
            o.run(c1, I)
            o.next_w()
            o.run(c1, F)
        for step in range(m - 2 * p + r + 1):
            if step == 0 and r == p - 1:
                o.run(c0, F)
                o.run(c1, B)
            else:
                o.overlap(c0, c1)
            o.overlap(c1, c0)
        for _ in range(p - r - 1):
            o.run(c1, B)
            o.overlap(c1, c0)
        split = False
        for step in range(r + 1):
            if step == (r + 1) // 2 and r % 2 == 1:
                split = True
            o.run(c1, I if split else B)
            if step == (r + 1) // 2 and r % 2 == 0:
                split = True
            o.run(c0, I if split else B)
        for _ in range(p - r - 1):
            o.next_w()
            o.run(c0, I if split else B)
        while o.pending_w:
            o.next_w()
        rows.append(o.order)
        pairs.append(tuple(o.pairs))
    return _schedule("dualpipev", p, m, rows, overlapped_pairs=tuple(pairs))


# --- V-Half and V-Min: building blocks (Controllable Memory, §3) ------------------------------------

#: Slot offsets (F0, F1, I1, I0) of microbatch 0 on rank r, from the paper's building blocks (the
#: offsets of sail-sg's zbv_greedy.py); microbatch k sits 6k slots later. A rank's four offsets differ
#: mod 6, so consecutive microbatches interleave without clashing and leave two slots of every six for
#: the W. The extra gap (2 when 3 | p for V-Min, 3 when 2 | p for V-Half) keeps the offsets apart mod 6.
_BLOCKS: dict[str, Callable[[int, int], tuple[int, int, int, int]]] = {
    "v-min": lambda p, r: (
        r,
        2 * p - 1 - r,
        2 * p + (2 if p % 3 == 0 else 0) + r,
        4 * p + (2 if p % 3 == 0 else 0) - 1 - r,
    ),
    "v-half": lambda p, r: (
        2 * r,
        3 * p - 2 - r,
        3 * p + (3 if p % 2 == 0 else 0) + 2 * r - 1,
        6 * p + (3 if p % 2 == 0 else 0) - 2 - r,
    ),
}


def block(name: str, p: int, r: int) -> tuple[int, int, int, int, int, int]:
    """Rank r's full building block: slot offsets of (F0, F1, I1, I0, W1, W0). W1 takes the first slot
    after I1 whose residue mod 6 is free, W0 the first free one after I0 (c1's W first, as sail-sg)."""
    f0, f1, i1, i0 = _BLOCKS[name](p, r)
    taken = {x % 6 for x in (f0, f1, i1, i0)}
    assert len(taken) == 4, (name, p, r)
    w1 = next(t for t in range(i1 + 1, i1 + 7) if t % 6 not in taken)
    taken.add(w1 % 6)
    w0 = next(t for t in range(i0 + 1, i0 + 7) if t % 6 not in taken)
    return f0, f1, i1, i0, w1, w0


def _from_block(name: str, p: int, m: int) -> Schedule:
    """Every rank's order: its block repeated every 6 slots for microbatches 0..m − 1, read by slot."""
    rows = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        kinds = ((c0, F), (c1, F), (c1, I), (c0, I), (c1, W), (c0, W))
        slots = {
            off + 6 * k: Action(stage, kind, k)
            for k in range(m)
            for (stage, kind), off in zip(kinds, block(name, p, r), strict=True)
        }
        rows.append([slots[t] for t in sorted(slots)])
    return _schedule(name, p, m, rows)


def block_memory(name: str, p: int, m: int) -> list[Fraction]:
    """Peak activation memory per rank of a block schedule, from the block alone: at slot t chunk c of
    microbatch k is alive when F_c + 6k ≤ t < W_c + 6k; the peak is the most alive at once, over 2."""
    peaks = []
    for r in range(p):
        f0, f1, _, _, w1, w0 = block(name, p, r)
        lives = ((f0, w0), (f1, w1))
        alive = [
            sum(1 for f, w in lives for k in range(m) if f + 6 * k <= t < w + 6 * k)
            for t in range(w0 + 6 * m)
        ]
        peaks.append(Fraction(max(alive), 2))
    return peaks


def _squeezed(name: str, p: int, m: int) -> Schedule:
    """The block schedule of ``name`` squeezed and reordered under its peak (:func:`squeeze`)."""
    rows = []
    kinds = {F0: F, F1: F, I1: I, I0: I, WW: W}
    for r, order in enumerate(squeeze([_BLOCKS[name](p, r) for r in range(p)], m)):
        chunks = (r, 2 * p - 1 - r)
        rows.append([Action(chunks[c], kinds[k], j) for k, j, c in order])
    return _schedule(name, p, m, rows)


def v_half(p: int, m: int, v: int = 2) -> Schedule:
    """V-Half (Controllable Memory, NeurIPS 2024): half of 1F1B's activation memory, about half its bubble.

    The block of :data:`_BLOCKS` repeated every 6 slots, then squeezed and reordered under the block's
    peak as the paper does (:func:`pipewright.schedules.vsqueeze.squeeze`). Exact memory of this code
    (p = 2..16, m = 1..2p + 2, 3p, 4p checked): min(⌊p/2⌋ + 1, m, (m + 1 + r)/2) microbatches of a rank's
    layers on rank r — ⌊p/2⌋ + 1 = (p + 2)//2 on every rank once m ≥ p + 1, the paper's figure, against
    1F1B's p. One iteration with unit costs (T_F = T_I = T_W = 1 per chunk) takes 6m + bubble once
    m ≥ p + 1, the bubble being 3p − 7 for even p ≥ 4, 3p − 4 for odd p and 1 for p = 2 (p ≤ 16
    checked) — under half of 1F1B's 6(p − 1); the block order alone (:func:`v_half_blocks`): 5, 7, 12,
    14, 19, 21, 26 for p = 2..8.
    """
    return _squeezed("v-half", p, m)


def v_half_blocks(p: int, m: int) -> Schedule:
    """V-Half's block order before the squeeze (``v-half`` without :mod:`.vsqueeze`): peak
    :func:`block_memory`, bubble 5, 7, 12, 14, 19, 21, 26 for p = 2..8 with unit costs."""
    return _from_block("v-half", p, m)


def _v_half_memory(p: int, m: int, v: int) -> list[Fraction]:
    return [min(Fraction(p // 2 + 1), Fraction(m), Fraction(m + 1 + r, 2)) for r in range(p)]


def v_min(p: int, m: int, v: int = 2) -> Schedule:
    """V-Min (Controllable Memory, NeurIPS 2024): the paper claims a third of 1F1B's activation memory and
    about two thirds of its bubble.

    The block of :data:`_BLOCKS` repeated every 6 slots, then squeezed and reordered under the block's
    peak over all ranks as the paper and its reference code do (:func:`squeeze`); for m ≥ 2p this is
    the reference's order pass for pass (p ≤ 8 checked), and for every m it is as fast or faster
    (:func:`v_min_blocks` is the order before the squeeze). Exact memory of this code for p ≤ m ≤ 3p:
    ⌊(p + 1)/3⌋ + 1 microbatches of a rank's layers on every rank, rank 0 half a microbatch less when
    p ≡ 2 (mod 3) (p = 8: [3.5, 4, 4, 4, 4, 4, 4, 4], as the reference) — the squeeze lets every rank
    rise to the block's largest peak. One iteration with unit costs at m = 3p: bubble 3, 5, 11, 15,
    17, 23, 27 for p = 2..8 (block order: 3, 9, 11, 15, 21, 23, 27; 1F1B: 6(p − 1)).
    """
    return _squeezed("v-min", p, m)


def v_min_blocks(p: int, m: int) -> Schedule:
    """V-Min's block order before the squeeze: peak :func:`block_memory`."""
    return _from_block("v-min", p, m)


def _zbv_memory(p: int, m: int, v: int) -> list[Fraction]:
    return [Fraction(min(2 * p, m + 1 + r, 2 * m), 2) for r in range(p)]


def _v_info(name: str, build: Callable[[int, int, int], Schedule], **fields: Any) -> ScheduleInfo:
    """A V-placement entry: exactly two chunks per rank."""
    return ScheduleInfo(name=name, build=build, chunks=(2,), default_chunks=2, **fields)


SCHEDULES = (
    _v_info(
        "zbv",
        zbv,
        build_costed=zbv_costed,
        memory=lambda p, m, v: peak_in_flight(zbv(p, m)),
        bubble="cost-aware greedy; (p − 1)·T_F for one iteration alone when T_F = T_I = T_W and m ≥ 2p − 1",
        memory_formula="at most the memory limit (p microbatches of a rank's layers by default)",
        source="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (ZB-V, the reference code's V greedy)",
    ),
    _v_info(
        "zbv-torch",
        zbv_torch,
        memory=_zbv_memory,
        bubble="0 in steady state when T_F = T_I = T_W (one iteration alone: (p − 1)·T_F for m ≥ 2p − 1)",
        memory_formula="min(2p, m + 1 + r, 2m)/2 on rank r (p once m ≥ 2p − 1)",
        source="PyTorch's ScheduleZBVZeroBubble (the handcrafted ZB-V of Qi et al., ICLR 2024)",
    ),
    _v_info(
        "v-half",
        v_half,
        memory=_v_half_memory,
        bubble="about half of 1F1B's or less (unit costs: 17 against 42 at p = 8, m ≥ p + 1)",
        memory_formula="min(⌊p/2⌋ + 1, m, (m + 1 + r)/2) on rank r (⌊p/2⌋ + 1 once m ≥ p + 1)",
        source="Qi et al., Pipeline Parallelism with Controllable Memory, NeurIPS 2024 (V-Half)",
    ),
    _v_info(
        "v-min",
        v_min,
        memory=lambda p, m, v: peak_in_flight(v_min(p, m)),
        bubble="about two thirds of 1F1B's or less (unit costs: 27 against 42 at p = 8, m = 3p)",
        memory_formula="⌊(p + 1)/3⌋ + 1 on every rank for p ≤ m ≤ 3p (rank 0: ½ less when p ≡ 2 mod 3)",
        source="Qi et al., Pipeline Parallelism with Controllable Memory, NeurIPS 2024 (V-Min)",
    ),
    _v_info(
        "dualpipev",
        dualpipev,
        memory=lambda p, m, v: [Fraction(2 * p + 1, 2)] * p,
        bubble="(p − 1)(F&B + B − 3W) (DeepSeek)",
        memory_formula="p + 1/2 on every rank",
        source="DeepSeek-AI, DualPipe repository (dualpipev.py); DeepSeek-V3 report, arXiv 2412.19437",
        min_microbatches=lambda p, v: 2 * p,
    ),
)
