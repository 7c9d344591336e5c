"""Classic synchronous schedules: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B and looped BFS.

Notation: p ranks, m microbatches, v model chunks per rank (stage s on rank s mod p). Bubble fractions
are idle over ideal time; memory is peak activations per rank in microbatches of a whole rank's layers
(one chunk-microbatch counts 1/v), exactly what :func:`pipewright.ir.peak_in_flight` reports.
"""

from __future__ import annotations

from fractions import Fraction

from pipewright.errors import ScheduleError
from pipewright.ir import STEP, Action, ActionColumns, B, F, Schedule, loop_placement
from pipewright.schedules.schedule_info import ScheduleInfo


def _warm_columns(name: str, p: int, m: int, v: int, f_stage, f_mb, b_stage, b_mb, warm) -> Schedule:
    """A schedule of forwards and backwards as :class:`ActionColumns`, without one object per action.

    Rank r's forwards are stages ``f_stage + r`` and microbatches ``f_mb``, its backwards ``b_stage + r``
    and ``b_mb`` (T entries each, numpy arrays), ``warm[r]`` its warm-up count w: the rank runs
    forwards 0 … w − 1, then forward w + i and backward i alternating for i < T − w, then backwards
    T − w … T − 1 (w = T: all forwards, then all backwards). Position i of a rank's 2T actions is
    forward i (i < w), forward w + (i − w)/2 or backward (i − w − 1)/2 alternating, then backward
    i − T (i ≥ 2T − w) — built for all ranks at once.
    """
    import numpy as np

    total = len(f_stage)
    i = np.arange(2 * total, dtype=np.int32)[None, :]
    w = np.asarray(warm, np.int32)[:, None]
    d = i - w
    steady = np.where(d % 2 == 0, w + d // 2, total + (d - 1) // 2)
    idx = np.where((i < w) | (i >= 2 * total - w), i, steady)  # index into forwards, then backwards
    stage = np.concatenate((f_stage, b_stage)).astype(np.int32)[idx] + np.arange(p, dtype=np.int32)[:, None]
    cols = ActionColumns(
        (F, B),
        (idx >= total).astype(np.int32).ravel(),
        stage.ravel(),
        np.concatenate((f_mb, b_mb)).astype(np.int32)[idx].ravel(),
        np.full(p, 2 * total, np.int64),
    )
    return Schedule.from_columns(name, m, cols, loop_placement(p, v))


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards.

    Bubble (p − 1)/m of the ideal time; every rank holds all m microbatches' activations at the peak.
    """
    import numpy as np

    ks, zero = np.arange(m), np.zeros(m, np.int32)
    return _warm_columns("gpipe", p, m, 1, zero, ks, zero, ks, [m] * p)


def one_f_one_b_rows(p: int, m: int, *, step_after_backward: bool = False) -> list[list[Action]]:
    """The 1F1B order of every rank: min(p − r − 1, m) warm-up forwards, then one forward and one
    backward alternating, then the remaining backwards. With ``step_after_backward`` each backward is
    followed by that stage's optimizer step (PipeDream's asynchronous 1F1B)."""

    def backward(r: int, k: int) -> list[Action]:
        return [Action(r, B, k), Action(r, STEP, k)] if step_after_backward else [Action(r, B, k)]

    rows = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Action(r, F, k) for k in range(warm)]
        for k in range(m - warm):
            row += [Action(r, F, warm + k), *backward(r, k)]
        for k in range(m - warm, m):
            row += backward(r, k)
        rows.append(row)
    return rows


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs min(p − r − 1, m) warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards.

    Bubble (p − 1)/m as GPipe; peak activation memory min(p − r, m) microbatches on rank r (p on rank 0).
    """
    import numpy as np

    ks, zero = np.arange(m), np.zeros(m, np.int32)
    return _warm_columns("1f1b", p, m, 1, zero, ks, zero, ks, [min(p - r - 1, m) for r in range(p)])


def megatron_order(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron-Core's forward order of (microbatch, chunk) on every rank (its ``get_schedule_table``).

    Microbatches go in groups of ``group`` (N): each group passes through chunk 0, then chunk 1, …,
    then chunk v − 1 before the next group starts; the last group holds what is left (m mod N or N).
    """
    order: list[tuple[int, int]] = []
    for start in range(0, m, group):
        members = range(start, min(start + group, m))
        order += [(k, c) for c in range(v) for k in members]
    return order


def check_interleaved(p: int, m: int, v: int, group: int | None = None) -> None:
    """Megatron-Core's rules for the interleaved schedule: p ≤ N ≤ m, and m mod N is 0 or at least p
    (a smaller last group would stall the pipeline). N defaults to p, so then m must be a multiple of p.
    N < p (Llama 3 §3.3.2 sets N freely) is refused: in this order, with the warm-up below, it deadlocks
    under blocking sends for most p and N (p = 4, N = 2 among them).
    """
    n = p if group is None else group
    if n < p:
        raise ScheduleError(f"interleaved-1f1b: the microbatch group N = {n} must be at least p = {p}")
    if m < n:
        raise ScheduleError(
            f"interleaved-1f1b with {p} stages needs at least {n} microbatches (got {m}); "
            f"raise --microbatches to {n} or more"
        )
    rest = m % n
    if 0 < rest < p:
        lower, upper = m - rest, m - rest + n
        raise ScheduleError(
            f"interleaved-1f1b groups microbatches {n} at a time and the last group of {rest} is smaller "
            f"than p = {p}; use --microbatches {lower} or {upper}"
        )


def interleaved_warmup(p: int, m: int, v: int, rank: int, group: int | None = None) -> int:
    """Warm-up forwards on ``rank`` (Megatron-Core): (p − r − 1)·2 + (v − 1)·N, capped at m·v."""
    n = p if group is None else group
    return min((p - rank - 1) * 2 + (v - 1) * n, m * v)


def interleaved_1f1b(p: int, m: int, v: int = 2, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC21), in exactly Megatron-Core's order.

    Rank r holds chunks r, r + p, …, r + (v − 1)p (loop placement). Forwards follow
    :func:`megatron_order`; rank r first runs w = (p − r − 1)·2 + (v − 1)·N of them (capped at m·v),
    then alternates one forward and one backward, then drains the rest of the backwards. The i-th
    backward takes the i-th entry of the same order with the chunk mirrored (v − 1 − c): backward
    visits the chunks in reverse. N (``group``) defaults to p; the rules on N are
    :func:`check_interleaved`'s. With v = 1 this is 1F1B with 2(p − r − 1) warm-up forwards, as PyTorch's
    ScheduleInterleaved1F1B with one local stage.

    Bubble (p − 1)/(v·m). Peak activation memory on rank r: min(w + 1, v·m) chunk-microbatches, i.e.
    min(2(p − r − 1) + (v − 1)·N + 1, v·m)/v microbatches of the rank's layers.
    """
    check_interleaved(p, m, v, group)
    import numpy as np

    order = np.array(megatron_order(m, v, p if group is None else group), np.int64).reshape(-1, 2)
    ks, fwd, bwd = order[:, 0], order[:, 1] * p, (v - 1 - order[:, 1]) * p
    warm = [interleaved_warmup(p, m, v, r, group) for r in range(p)]
    return _warm_columns("interleaved-1f1b", p, m, v, fwd, ks, bwd, ks, warm)


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Looped breadth-first pipeline (Lamy-Poirier, arXiv 2211.05953), as PyTorch's ScheduleLoopedBFS.

    Each rank runs, for its chunks in order, the forwards of all m microbatches; then, for its chunks
    in reverse order, the backwards of all microbatches from the last to the first.

    Bubble (p − 1)/(v·m) when m ≥ p; peak activation memory m (every microbatch on every chunk).
    """
    import numpy as np

    chunk = np.repeat(np.arange(v) * p, m)
    ks = np.tile(np.arange(m), v)
    return _warm_columns("looped-bfs", p, m, v, chunk, ks, chunk[::-1], ks[::-1], [m * v] * p)


def interleaved_memory(p: int, m: int, v: int, group: int | None = None) -> list[Fraction]:
    """Peak activation memory of interleaved 1F1B on each rank, in microbatches: its warm-up forwards
    (p − r − 1)·2 + (v − 1)·N plus one, capped at v·m, chunk-microbatches of 1/v each."""
    return [Fraction(min(interleaved_warmup(p, m, v, r, group) + 1, m * v), v) for r in range(p)]


#: what a schedule that groups its microbatches registers in ``ScheduleInfo.extra`` (--microbatch-group)
GROUPED = {"build_grouped": interleaved_1f1b, "memory_grouped": interleaved_memory}


SCHEDULES = (
    ScheduleInfo(
        name="gpipe",
        build=gpipe,
        memory=lambda p, m, v: [Fraction(m)] * p,
        bubble="(p − 1)/m",
        memory_formula="m",
        source="Huang et al., GPipe, NeurIPS 2019",
    ),
    ScheduleInfo(
        name="1f1b",
        build=one_f_one_b,
        memory=lambda p, m, v: [Fraction(min(p - r, m)) for r in range(p)],
        bubble="(p − 1)/m",
        memory_formula="min(p − r, m) on rank r",
        source="Narayanan et al., PipeDream-Flush / Megatron-LM, SC21",
    ),
    ScheduleInfo(
        name="interleaved-1f1b",
        build=interleaved_1f1b,
        memory=interleaved_memory,
        bubble="(p − 1)/(v·m)",
        memory_formula="min(2(p − r − 1) + (v − 1)·p + 1, v·m)/v on rank r",
        source="Narayanan et al., Megatron-LM PTD-P, SC21; order of Megatron-Core",
        chunks=None,
        default_chunks=2,
        min_microbatches=lambda p, v: p,
        check=check_interleaved,
        extra=GROUPED,
    ),
    ScheduleInfo(
        name="looped-bfs",
        build=looped_bfs,
        memory=lambda p, m, v: [Fraction(m)] * p,
        bubble="(p − 1)/(v·m) for m ≥ p",
        memory_formula="m",
        source="Lamy-Poirier, Breadth-First Pipeline Parallelism, MLSys 2023; PyTorch ScheduleLoopedBFS",
        chunks=None,
        default_chunks=2,
    ),
)
