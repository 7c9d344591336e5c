"""The vocabulary-parallel 1F1B pass order of the authors' code, as a pipewright schedule
(Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism", arXiv 2411.05288;
sail-sg/VocabularyParallelism, ``megatron/core/pipeline_parallel/vocab_parallel_schedule.py``,
``forward_backward_pipelining_with_vocab_parallel``): Algorithm 2 (its default, backward fusion on)
and Algorithm 1 (``--disable-backward-fusion``).

Our own re-statement of that function's control flow, with each pass recorded instead of run (the
names are those ``tools/vp_trace.py`` records when it runs the authors' function itself):

- ``F{k}`` / ``B{k}``: the transformer stage's forward / backward of microbatch k;
- ``X{k}``: the broadcast of X(k) (and ∇loss(k − 1)) is issued: on the last rank (the root, which
  does not wait for it) right after F(0), then before the layers of B(k − 1) (Algorithm 2: the loss
  backward of k − 1 comes first) or after the loss of k − 1, ahead of B(k − 2) (Algorithm 1); the
  last, ∇loss(m − 1) alone, at the end (Algorithm 2); on the others where the reference posts the
  receive;
- ``S{k}``: the output-layer step of microbatch k, fused: T(k − 1) then S(k) (``S{m}``: T(m − 1) only);
- ``C{k}``: the reduction issued after ``S{k}`` (Algorithm 2: statistics and the SUM of the rescaled
  ∇X; Algorithm 1: the statistics), ``G{k}``: Algorithm 1's SUM of T(k)'s ∇X, issued after ``C{k+1}``;
- ``EF{k}`` / ``EC{k}``: the embedding forward's compute / its SUM to stage 0;
- ``EX{k}`` / ``EB{k}``: the embedding backward's broadcast of ∇ from stage 0 / its compute.

Every rank runs min(p − r, m) + 1 forwards before its first backward (Algorithm 1: one more). Where
the S passes go is fixed per rank from the pass times f (forward), b (backward) and c (the reference's
embedding-forward timer; it only has to satisfy f ≥ c): walking from the last rank to the first, the
offset between the rank's S and its own 1F1B slot either drops by f (S stays before the forward, "BSF")
or, when that would pass −b, the rank runs S after its forward ("BFS") and the offset grows by b − f.
Without profiled timers the reference takes f = 1, b = 2, c = 0.

:func:`reference_schedule` maps the passes to pipewright's kinds on 1F1B: ``F``/``B`` → ``F``/``B``,
``X{k}`` → ``VBX(k)`` (X(m), ∇loss(m − 1) alone, has no counterpart: pipewright's T takes dℓ as the
executor's constant loss scale), ``S{k}`` → ``VT(k − 1)`` then ``VS(k)``, ``C{k}`` → ``VC0(k)``,
``G{k}`` → ``VC1(k)``, ``EF``/``EC`` → ``VEF``/``VEC``, ``EX``/``EB`` → ``VEBC``/``VEB``.
"""

from __future__ import annotations

from collections.abc import Callable

from pipewright.errors import ScheduleError
from pipewright.features.vocab.kinds import VBX, VC0, VC1, VEB, VEBC, VEC, VEF, VS, VT, registry
from pipewright.ir import Action, B, F, Schedule, loop_placement

#: the algorithms the reference implements
REFERENCE_ALGORITHMS = ("alg1", "alg2")


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


class _Rank:
    """One rank's walk through the reference function, noting each pass it issues (``out``)."""

    def __init__(self, rank: int, p: int, m: int, fused: bool, f: float, b: float) -> None:
        is_bsf, offsets, self.warm_s = s_placement(p, f, b)
        self.rank, self.p, self.m, self.fused = rank, p, m, fused
        self.bsf, self.off, self.f, self.b = is_bsf[rank], offsets[rank], f, b
        self.last = rank == p - 1
        self.wo = 0 if fused else 1  # Algorithm 1's extra warm-up step
        self.out: list[str] = []
        self.ef_left = self.eb_left = self.s_left = m
        self.s = -1  # the last output-layer step
        self.ef_cb: Callable[[], None] = _nothing
        self.eb_cb: Callable[[], None] = _nothing
        self.recv = 0

    # -- passes --------------------------------------------------------------------------------------
    def embed_forward(self) -> Callable[[], None]:
        k = self.m - self.ef_left
        self.ef_left -= 1
        self.out.append(f"EF{k}")
        return lambda: self.out.append(f"EC{k}")

    def embed_backward(self) -> Callable[[], None]:
        k = self.m - self.eb_left
        self.eb_left -= 1
        self.out.append(f"EX{k}")
        return lambda: self.out.append(f"EB{k}")

    def lm_head(self, k: int) -> None:
        self.out.append(f"S{k}")
        self.s = k
        self.s_left -= 1

    def reduce(self) -> None:
        """Algorithm 2: one block (statistics, then the SUM of ∇X) after step k; Algorithm 1: the
        statistics of S(k) (``C``), then the SUM of T(k − 1)'s ∇X (``G``)."""
        k = self.s
        if self.fused or k < self.m:
            self.out.append(f"C{k}")
        if not self.fused and k > 0:
            self.out.append(f"G{k - 1}")

    def receive(self, k: int) -> int:
        if not self.last:  # the last rank is the root: it broadcasts from its own passes
            self.out.append(f"X{k}")
        return k

    def forward(self, k: int) -> None:
        self.out.append(f"F{k}")
        if self.last and k == 0:
            self.out.append("X0")

    def loss(self, k: int) -> None:
        """Algorithm 1 on the last rank: the loss of k, then the broadcast of X(k + 1) with ∇loss(k)."""
        if not self.fused and self.last:
            self.out.append(f"X{k + 1}")

    def backward(self, k: int) -> None:
        if self.fused and self.last and k < self.m - 1:  # X(k + 1), ∇loss(k) before B(k)'s layers
            self.out.append(f"X{k + 1}")
        self.out.append(f"B{k}")

    # -- the reference's phases ------------------------------------------------------------------------
    def warm_s_step(self, i: int) -> None:
        """Warm-up output-layer step i (the rank runs warm_s[rank] of them before its first B)."""
        if self.s_left < 1 - self.wo:
            return
        self.lm_head(self.receive(i + 1 + self.wo))
        ef = _nothing
        if i + 1 >= self.warm_s[0] and self.ef_left > 0:
            ef = self.embed_forward()
        ef()  # the reference calls it with the reduction before or after a transfer, not a pass
        self.reduce()

    def post_embed_backward_and_receive(self, cooldown: bool) -> None:
        """Issue the next embedding backward's broadcast (from the third step on) and post the receive
        of the next X (in the cooldown only while steps are left)."""
        self.eb_cb = _nothing
        if self.m - self.s_left >= self.warm_s[0] + 2 + self.wo:
            self.eb_cb = self.embed_backward()
        if not cooldown or self.s_left >= 1 - self.wo:
            self.recv = self.receive(self.m - self.s_left)

    def step(self, cooldown: bool) -> bool:
        """The output-layer step of the posted receive (in the cooldown only while steps are left);
        the steady state also runs the next embedding forward. True if a step ran."""
        ran = False
        if not cooldown or self.s_left >= 1 - self.wo:
            self.lm_head(self.recv)
            ran = True
            if not cooldown:
                self.ef_cb = _nothing
                if self.m - self.s_left - 1 >= self.warm_s[0] + self.wo and self.ef_left > 0:
                    self.ef_cb = self.embed_forward()
        self.eb_cb()
        return ran

    def flush(self, cooldown: bool) -> None:
        if not cooldown:
            self.ef_cb()
        self.reduce()

    def iteration(self, bk: int, fk: int | None) -> None:
        """One iteration of the steady state (``fk``: the forward it runs) or of the cooldown (None):
        the backward, the output-layer step before (BSF) or after (BFS) the forward, the reduction."""
        cooldown = fk is None
        early = self.bsf or self.off - self.f > -self.b
        if early:
            self.post_embed_backward_and_receive(cooldown)
        if bk + 1 < self.m:
            self.loss(bk + 1)
        self.backward(bk)
        ran = self.step(cooldown) if self.bsf else False
        if ran and self.off + self.f >= 0:
            self.flush(cooldown)
            ran = False
        if not early:
            self.post_embed_backward_and_receive(cooldown)
        if fk is not None:
            self.forward(fk)
        if not self.bsf:
            ran = self.step(cooldown)
        if ran:
            self.flush(cooldown)


def _nothing() -> None:
    return None


def rank_order(
    rank: int, p: int, m: int, f: float = 1.0, b: float = 2.0, algorithm: str = "alg2"
) -> list[str]:
    """The passes of ``rank`` in the order the reference issues them: Algorithm 2 (``alg2``, the
    reference's default) or Algorithm 1 (``alg1``, its ``--disable-backward-fusion``). The reference
    needs m > p (its warm-up runs p + 1 embedding forwards)."""
    if algorithm not in REFERENCE_ALGORITHMS:
        raise ScheduleError(f"the reference implements alg1 and alg2, not {algorithm!r}")
    if not (0 <= rank < p and p < m):
        raise ScheduleError(
            f"the reference's schedule needs 0 <= rank < p < m (got rank={rank}, p={p}, m={m})"
        )
    fused = algorithm == "alg2"
    r = _Rank(rank, p, m, fused, f, b)
    warmup = min(p - rank, m)
    remaining = max(0, m - warmup - 1 - r.wo)
    for _ in range(min(p, m) - warmup + 1):
        r.embed_forward()()
    for i in range(warmup):
        r.embed_forward()()
        r.forward(i)
    r.lm_head(r.receive(0))
    r.reduce()
    if not fused:
        r.embed_forward()()
    if warmup + 1 <= m:
        r.forward(warmup)
    if not fused:
        r.loss(0)
        r.lm_head(r.receive(1))
        r.reduce()
        if warmup + 2 <= m:
            r.forward(warmup + 1)
    for i in range(r.warm_s[rank]):
        r.warm_s_step(i)
    for i in range(remaining):
        r.iteration(i, i + warmup + 1 + r.wo)
    for i in range(m - remaining):
        r.iteration(i + remaining, None)
    while r.eb_left > 0:
        r.embed_backward()()
    if fused:
        if r.last:
            r.out.append(f"X{m}")
        r.lm_head(r.receive(m))
    return r.out


#: the passes that issue a collective on the output layer's communicator
COLLECTIVES = ("X", "EC", "EX", "C", "G")


def orders(p: int, m: int, f: float = 1.0, b: float = 2.0, algorithm: str = "alg2") -> list[list[str]]:
    """Every rank's order (:func:`rank_order`)."""
    return [rank_order(r, p, m, f, b, algorithm) for r in range(p)]


_SIMPLE = {"F": F, "B": B, "X": VBX, "C": VC0, "G": VC1, "EF": VEF, "EC": VEC, "EX": VEBC, "EB": VEB}


def reference_schedule(p: int, m: int, f: float = 1.0, b: float = 2.0, algorithm: str = "alg2") -> Schedule:
    """1F1B with the vocabulary passes of ``algorithm`` in the reference's order (:func:`orders`), stage
    r on rank r (``meta["vocab_parallel"] = algorithm``, ``meta["order"] = "reference"``)."""
    rows: list[list[Action]] = []
    for r, order in enumerate(orders(p, m, f, b, algorithm)):
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
        kinds=registry(algorithm, base.kinds),
        meta={**base.meta, "vocab_parallel": algorithm, "order": "reference"},
    )
