"""The vocabulary-parallel 1F1B pass order of the authors' code, as a pipewright schedule
(Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism", arXiv 2411.05288;
sail-sg/VocabularyParallelism, ``megatron/core/pipeline_parallel/vocab_parallel_schedule.py``,
``forward_backward_pipelining_with_vocab_parallel``), Algorithm 2 (its default, backward fusion on).

Our own re-statement of that function's control flow, with each pass recorded instead of run:

- ``F{k}`` / ``B{k}``: the transformer stage's forward / backward of microbatch k (on the last rank
  B(k) also computes the loss and broadcasts X(k + 1) with ∇loss(k); after B(m − 1) the last
  broadcast, ∇loss(m − 1) alone, is issued at the end);
- ``X{k}``: the broadcast of X(k) (and ∇loss(k − 1)) is issued: on the last rank right after F(0) and
  B(k − 1) (the root does not wait for it), on the others where the reference posts the receive;
- ``S{k}``: the output-layer step of microbatch k, fused: T(k − 1) then S(k) (``S{m}``: T(m − 1) only);
- ``C{k}``: the reduction issued after ``S{k}`` (statistics and the SUM of the rescaled ∇X);
- ``EF{k}`` / ``EC{k}``: the embedding forward's compute / its SUM to stage 0;
- ``EX{k}`` / ``EB{k}``: the embedding backward's broadcast of ∇ from stage 0 / its compute.

Where the S passes go is fixed per rank from the pass times f (forward), b (backward) and c (the
reference's third timer; it only has to satisfy f ≥ c): walking from the last rank to the first, the
offset between the rank's S and its own 1F1B slot either drops by f (S stays before the forward, "BSF")
or, when that would pass −b, the rank runs S after its forward ("BFS") and the offset grows by b − f.
Without profiled timers the reference takes f = 1, b = 2, c = 0.

:func:`reference_schedule` maps the passes to pipewright's kinds on 1F1B: ``F``/``B`` → ``F``/``B``,
``X{k}`` → ``VBX(k)`` (X(m), ∇loss(m − 1) alone, has no counterpart), ``S{k}`` → ``VT(k − 1)`` then
``VS(k)``, ``C{k}`` → ``VC0(k)``, ``EF``/``EC`` → ``VEF``/``VEC``, ``EX``/``EB`` → ``VEBC``/``VEB``.
"""

from __future__ import annotations

from collections.abc import Callable

from pipewright.errors import ScheduleError
from pipewright.features.vocab.kinds import VBX, VC0, VEB, VEBC, VEC, VEF, VS, VT, registry
from pipewright.ir import Action, B, F, Schedule, loop_placement


def _kind(name: str) -> str:
    return name.rstrip("0123456789")


def s_placement(p: int, f: float = 1.0, b: float = 2.0) -> tuple[list[bool], list[float], list[int]]:
    """(is_bsf, offsets, warm-up S passes) per rank, as the reference derives them from f and b."""
    if not b >= f:
        raise ScheduleError(f"the reference's S placement needs b >= f (got f={f}, b={b})")
    offset = 0.0
    is_bsf, offsets = [True], [0.0]
    while len(is_bsf) < p:
        if offset - f >= -b:
            offset -= f
            is_bsf.append(True)
            offsets.append(offset)
        else:
            is_bsf.append(False)
            offsets.append(offset)
            offset += b - f
            is_bsf.append(True)
            offsets.append(offset)
    del is_bsf[p:], offsets[p:]
    is_bsf.reverse()
    offsets.reverse()
    warm = [0] * p
    for r in range(p - 2, -1, -1):
        warm[r] = warm[r + 1] if (not is_bsf[r + 1] and is_bsf[r]) else warm[r + 1] + 1
    return is_bsf, offsets, warm


def rank_order(rank: int, p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[str]:
    """The passes of ``rank`` in the order the reference issues them (Algorithm 2). The reference needs
    m > p (its warm-up runs p + 1 embedding forwards)."""
    if not (0 <= rank < p and p < m):
        raise ScheduleError(
            f"the reference's schedule needs 0 <= rank < p < m (got rank={rank}, p={p}, m={m})"
        )
    is_bsf, offsets, warm_s = s_placement(p, f, b)
    bsf, off = is_bsf[rank], offsets[rank]
    last = rank == p - 1
    out: list[str] = []
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    state = {"s": -1}

    def embed_forward(k: int) -> Callable[[], None]:
        out.append(f"EF{k}")
        return lambda: out.append(f"EC{k}")

    def embed_backward(k: int) -> Callable[[], None]:
        out.append(f"EX{k}")
        return lambda: out.append(f"EB{k}")

    def lm_head(k: int) -> None:
        out.append(f"S{k}")
        state["s"] = k

    def reduce() -> None:
        out.append(f"C{state['s']}")

    def receive(k: int) -> int:
        if not last:  # the last rank is the root: it broadcasts from its own passes
            out.append(f"X{k}")
        return k

    def forward(k: int) -> None:
        out.append(f"F{k}")
        if last and k == 0:
            out.append("X0")

    def backward(k: int) -> None:
        if last and k < m - 1:  # the root broadcasts X(k + 1) with ∇loss(k) before B(k)'s layers
            out.append(f"X{k + 1}")
        out.append(f"B{k}")

    warmup = min(p - rank, m)
    first_warmup = min(p, m)
    remaining = max(0, m - warmup - 1)
    ef_left = eb_left = m
    for i in range(first_warmup - warmup + 1):
        embed_forward(i)()
        ef_left -= 1
    for i in range(warmup):
        embed_forward(m - ef_left)()
        ef_left -= 1
        forward(i)
    s_left = m
    lm_head(receive(0))
    s_left -= 1
    reduce()
    if warmup + 1 <= m:
        forward(warmup)
    for i in range(warm_s[rank]):
        if s_left >= 1:
            lm_head(receive(i + 1))
            ef_cb = nothing
            if i + 1 >= warm_s[0] and ef_left > 0:
                ef_cb = embed_forward(m - ef_left)
                ef_left -= 1
            if rank == p - 2 or not is_bsf[rank + 1]:
                ef_cb()
                reduce()
            if rank != p - 2 and is_bsf[rank + 1]:
                ef_cb()
                reduce()
            s_left -= 1
    eb_cb: Callable[[], None] = nothing
    ef_cb = nothing
    for i in range(remaining):
        if bsf or off - f > -b:
            eb_cb = nothing
            if m - s_left >= warm_s[0] + 2:
                eb_cb = embed_backward(m - eb_left)
                eb_left -= 1
            recv = receive(m - s_left)
        backward(i)
        if bsf:
            lm_head(recv)
            ef_cb = nothing
            if m - s_left >= warm_s[0] and ef_left > 0:
                ef_cb = embed_forward(m - ef_left)
                ef_left -= 1
            eb_cb()
            s_left -= 1
        if bsf and off + f >= 0:
            ef_cb()
            reduce()
        if not bsf and off - f <= -b:
            eb_cb = nothing
            if m - s_left >= warm_s[0] + 2:
                eb_cb = embed_backward(m - eb_left)
                eb_left -= 1
            recv = receive(m - s_left)
        forward(i + warmup + 1)
        if not bsf:
            lm_head(recv)
            ef_cb = nothing
            if m - s_left >= warm_s[0] and ef_left > 0:
                ef_cb = embed_forward(m - ef_left)
                ef_left -= 1
            eb_cb()
            s_left -= 1
        if not bsf or off + f < 0:
            ef_cb()
            reduce()
    for i in range(m - remaining):
        if bsf or off - f > -b:
            eb_cb = nothing
            if m - s_left >= warm_s[0] + 2:
                eb_cb = embed_backward(m - eb_left)
                eb_left -= 1
            if s_left >= 1:
                recv = receive(m - s_left)
        backward(i + remaining)
        s_done = False
        if bsf:
            if s_left >= 1:
                lm_head(recv)
                s_left -= 1
                s_done = True
            eb_cb()
        if s_done and off + f >= 0:
            reduce()
            s_done = False
        if not bsf and off - f <= -b:
            eb_cb = nothing
            if m - s_left >= warm_s[0] + 2:
                eb_cb = embed_backward(m - eb_left)
                eb_left -= 1
            if s_left >= 1:
                recv = receive(m - s_left)
        if not bsf:
            if s_left >= 1:
                lm_head(recv)
                s_left -= 1
                s_done = True
            eb_cb()
        if s_done:
            reduce()
    while eb_left > 0:
        embed_backward(m - eb_left)()
        eb_left -= 1
    if last:
        out.append(f"X{m}")
    lm_head(receive(m))
    return out


#: the passes that issue a collective on the output layer's communicator
COLLECTIVES = ("X", "EC", "EX", "C")


def orders(p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[list[str]]:
    """Every rank's order (:func:`rank_order`)."""
    return [rank_order(r, p, m, f, b) for r in range(p)]


def collective_sequence(order: list[str]) -> list[str]:
    """The passes of ``order`` that issue a collective on the output layer's communicator, which every
    rank must issue in the same sequence."""
    return [a for a in order if _kind(a) in COLLECTIVES]


_SIMPLE = {"F": F, "B": B, "X": VBX, "C": VC0, "EF": VEF, "EC": VEC, "EX": VEBC, "EB": VEB}


def reference_schedule(p: int, m: int, f: float = 1.0, b: float = 2.0) -> Schedule:
    """1F1B with the vocabulary passes of Algorithm 2 in the reference's order (:func:`orders`), stage r
    on rank r (``meta["vocab_parallel"] = "alg2"``, ``meta["order"] = "reference"``)."""
    rows: list[list[Action]] = []
    for r, order in enumerate(orders(p, m, f, b)):
        row: list[Action] = []
        for name in order:
            kind, k = _kind(name), int(name[len(_kind(name)) :])
            if kind == "S":
                if k > 0:
                    row.append(Action(r, VT, k - 1))
                if k < m:
                    row.append(Action(r, VS, k))
            elif k < m:  # X(m) carries only ∇loss(m − 1), which pipewright's T does not wait for
                row.append(Action(r, _SIMPLE[kind], k))
        rows.append(row)
    base = Schedule.build("1f1b", m, rows, loop_placement(p))
    return Schedule(
        name=base.name,
        num_ranks=base.num_ranks,
        num_stages=base.num_stages,
        num_microbatches=base.num_microbatches,
        placement=base.placement,
        actions=base.actions,
        kinds=registry("alg2", base.kinds),
        meta={**base.meta, "vocab_parallel": "alg2", "order": "reference"},
    )
