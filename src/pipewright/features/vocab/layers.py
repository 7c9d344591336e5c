"""The vocabulary-parallel layers over a torch.distributed group: the collectives around :mod:`.shard`.

All p·t ranks of a pipeline (every pipeline rank and the tensor ranks within it) form the vocabulary
group; rank q of it holds shard q = pp_rank·t + tp_rank. Each microbatch of the output layer runs

    broadcast X from the last stage ─► S ─► barrier(s) ─► loss ─► T ─► ∇X back to the last stage

with the barriers of the chosen algorithm:

- ``naive``: three all-reduces — MAX of the local maxima (S must wait for it), SUM of Σexp and the
  target logit, SUM of ∇X after T;
- ``alg1``: C0 = one all-gather of each shard's (m, Σexp, target) merged by the online softmax after S,
  C1 = SUM of ∇X after T;
- ``alg2``: one barrier after S: the statistics all-gather, then the SUM of the already rescaled
  partial ∇X; T computes ∇W only.

Every collective is issued with ``async_op=True`` and returns a :class:`Pending`; a rank waits only
where it needs the result, so the transfer overlaps the rank's next transformer pass. Statistics,
gradients, the X broadcast and the embedding traffic each use their own communicator, so the order in
which a rank interleaves them does not have to match across ranks — only the microbatch order within
each kind does (the schedule guarantees it).

The input embedding: each rank looks up its rows (zeros for foreign ids) and the SUM reduction
delivers the embedding output to stage 0; backward, stage 0 broadcasts ∇output and each rank scatters
it into its rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipewright.errors import ConfigError
from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.kinds import ALGORITHMS


@dataclass
class Pending:
    """An issued asynchronous collective and what to do with its result once it has arrived."""

    work: Any
    then: Callable[[], Any] = lambda: None
    _done: bool = False
    _value: Any = None
    waited_s: float = 0.0  # time spent blocked in the collective (not in ``then``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self) -> Any:
        """The result; the first caller waits for the collective and runs ``then`` (thread-safe: a second
        thread waits for the first, as the reduction thread and the executor may both ask)."""
        with self._lock:
            if not self._done:
                if self.work is not None:
                    t0 = time.perf_counter()
                    self.work.wait()
                    self.waited_s = time.perf_counter() - t0
                self._value = self.then()
                self._done = True
        return self._value


@dataclass
class VocabGroup:
    """The vocabulary group of one rank.

    ``ranks[q]``: the global rank holding shard q (so ``ranks[(p − 1)·t]``, the last stage's first
    tensor rank, broadcasts X). ``tp``: tensor ranks per stage. One communicator per traffic kind
    (statistics, input gradients, X broadcast, embedding reduction, embedding-gradient broadcast).
    """

    ranks: list[int]
    tp: int
    index: int
    stats: Any
    grads: Any
    bcast: Any
    embed: Any
    embed_back: Any

    @classmethod
    def create(cls, ranks: list[int], tp: int = 1) -> VocabGroup:
        """Collective over the whole world (every rank calls it with the same ``ranks``)."""
        if len(ranks) % tp:
            raise ConfigError(f"{len(ranks)} ranks do not split into tensor groups of {tp}")
        groups = [dist.new_group(ranks) for _ in range(5)]
        me = dist.get_rank()
        index = ranks.index(me) if me in ranks else -1
        return cls(list(ranks), tp, index, *groups)

    @property
    def shards(self) -> int:
        return len(self.ranks)

    @property
    def pp(self) -> int:
        return self.shards // self.tp

    @property
    def pp_rank(self) -> int:
        return self.index // self.tp

    @property
    def last_stage_src(self) -> int:
        """Global rank that broadcasts the last stage's output (its tensor rank 0)."""
        return self.ranks[(self.pp - 1) * self.tp]

    @property
    def first_stage_src(self) -> int:
        return self.ranks[0]


# --------------------------------------------------------------------------- input embedding


class VocabEmbedding:
    """The input embedding split along the vocabulary (``weight``: this rank's V_p rows)."""

    def __init__(self, weight: Tensor, vocab: int, group: VocabGroup) -> None:
        self.weight, self.vocab, self.group = weight, vocab, group
        self.start, _, _ = vs.shard_range(vocab, group.shards, group.index)

    def forward(self, ids: Tensor) -> Pending:
        """Local lookup, then the SUM reduction to stage 0 (all-reduce when t > 1, so every tensor
        rank of stage 0 has it). ``Pending.wait()`` gives the embedding output (meaningful on stage 0)."""
        return self.reduce(self.lookup(ids))

    def lookup(self, ids: Tensor) -> Tensor:
        """This rank's rows for ``ids`` (zeros for the ids other ranks hold)."""
        return vs.embedding_forward(ids, self.weight.detach(), self.start)

    def reduce(self, out: Tensor) -> Pending:
        """Issue the SUM of the lookups to stage 0 (see :meth:`forward`)."""
        g = self.group
        if g.tp == 1:
            work = dist.reduce(out, dst=g.first_stage_src, group=g.embed, async_op=True)
        else:
            work = dist.all_reduce(out, group=g.embed, async_op=True)
        return Pending(work, lambda: out)

    def backward(self, ids: Tensor, grad_out: Tensor | None) -> Pending:
        """Stage 0 broadcasts ∇output (``grad_out``, None elsewhere); every rank then accumulates its
        rows' gradient into ``weight.grad``."""
        g = self.group
        buf = grad_out.contiguous() if grad_out is not None else None
        if buf is None:
            buf = self.weight.new_empty(*ids.shape, self.weight.shape[1])
        work = dist.broadcast(buf, src=g.first_stage_src, group=g.embed_back, async_op=True)

        def then() -> None:
            grad = vs.embedding_backward(ids, buf, self.start, self.weight.shape[0])
            _accumulate(self.weight, grad)

        return Pending(work, then)


def _accumulate(param: Tensor, grad: Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


# --------------------------------------------------------------------------- output layer


@dataclass
class _Microbatch:
    x: Tensor
    labels: Tensor
    s: vs.SResult | None = None
    merged: Pending | None = None
    grad_x: Pending | None = None
    extra: dict = field(default_factory=dict)


class VocabOutput:
    """Output layer + cross-entropy split along the vocabulary (``weight``: this rank's V_p rows).

    Per microbatch k, on every rank of the group, in this order: :meth:`receive_input` (the broadcast
    of X from the last stage), :meth:`s_pass` (issues the first barrier), :meth:`loss` (waits for it),
    :meth:`t_pass` with the per-token loss gradient (issues the ∇X reduction in naive/alg1), and on the
    last stage :meth:`input_grad`. ``chunk``: process the shard's logits ``chunk`` tokens at a time and
    recompute them in T (bounds the [tokens × V_p] memory; Algorithms 1 and 2).
    """

    def __init__(
        self, weight: Tensor, vocab: int, group: VocabGroup, algorithm: str = "alg2", chunk: int | None = None
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"vocabulary algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if chunk is not None and algorithm == "naive":
            raise ConfigError("the chunked output layer needs --vocab-parallel alg1 or alg2")
        self.weight, self.vocab, self.group, self.algorithm, self.chunk = (
            weight,
            vocab,
            group,
            algorithm,
            chunk,
        )
        self.source = group.last_stage_src  # the global rank that broadcasts X (set for V placements)
        self.start, _, self.valid = vs.shard_range(vocab, group.shards, group.index)
        self._mb: dict[int, _Microbatch] = {}

    # -- communication of X ------------------------------------------------------------------
    def receive_input(self, mb: int, x: Tensor | None, labels: Tensor, shape: tuple[int, int]) -> Pending:
        """Broadcast X of ``mb`` ([tokens, h]) from the last stage (``x`` there, None elsewhere)."""
        buf = x.detach().contiguous() if x is not None else self.weight.new_empty(shape)
        work = dist.broadcast(buf, src=self.source, group=self.group.bcast, async_op=True)
        state = _Microbatch(buf, labels.reshape(-1))
        self._mb[mb] = state
        return Pending(work, lambda: buf)

    # -- S and the barrier after it --------------------------------------------------------------
    def s_max(self, mb: int) -> Pending:
        """Naive algorithm, S up to its first barrier (action ``VSM``): the local logits and their row
        maxima, and the MAX all-reduce of the maxima issued (barrier 1, action ``VCM``); returns it.
        :meth:`s_pass` continues once it has completed."""
        st = self._mb[mb]
        z, local_max = vs.naive_s_max(st.x, self.weight.detach(), self.valid)
        work = dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=self.group.stats, async_op=True)
        st.extra["max"] = Pending(work, lambda: (z, local_max))
        return st.extra["max"]

    def row_max(self, mb: int) -> Pending:
        """The MAX all-reduce :meth:`s_max` issued for ``mb``."""
        return self._mb[mb].extra["max"]

    def s_pass(self, mb: int) -> Pending:
        """Pass S of ``mb`` and the barrier after it (issued, not waited for); returns the merge. Naive
        algorithm: the rest of S after :meth:`s_max` (called here first if it was not)."""
        st = self._mb[mb]
        w = self.weight.detach()
        g = self.group
        if self.algorithm == "naive":
            if "max" not in st.extra:
                self.s_max(mb)
            z, local_max = st.extra.pop("max").wait()  # barrier 1: the global max
            e, stats = vs.naive_s_sum(z, st.labels, self.start, local_max)
            sums = torch.stack([stats.sumexp, stats.target])
            work = dist.all_reduce(sums, group=g.stats, async_op=True)  # barrier 2

            def merged_naive() -> vs.Stats:
                merged = vs.Stats(local_max, sums[0], sums[1])
                st.s = vs.SResult(merged, e.div_(merged.sumexp.unsqueeze(1)), None)
                return merged

            st.merged = Pending(work, merged_naive)
            return st.merged
        fused = self.algorithm == "alg2"
        if self.chunk is None:
            st.s = vs.s_pass(st.x, w, st.labels, self.start, self.valid, fused=fused)
        else:
            st.s = vs.s_pass_chunked(
                st.x, w, st.labels, self.start, self.valid, fused=fused, chunk=self.chunk
            )
        local = st.s.stats.stacked()
        flat = local.new_empty(g.shards * local.shape[0], local.shape[1])
        work = dist.all_gather_single(flat, local, group=g.stats, async_op=True)
        gathered = flat.view(g.shards, *local.shape)
        if not fused:
            st.merged = Pending(work, lambda: vs.merge_stacked(gathered))
            return st.merged

        def merged_alg2() -> vs.Stats:
            merged = vs.merge_stacked(gathered)
            piece = vs.alg2_input_grad_piece(st.s.grad_pieces, st.s.stats, merged)
            st.s.grad_pieces = None  # the [n, h] pieces are folded into ``piece``
            reduce = dist.all_reduce(piece, group=g.grads, async_op=True)
            st.grad_x = Pending(reduce, lambda: piece)
            return merged

        st.merged = Pending(work, merged_alg2)
        return st.merged

    def loss(self, mb: int) -> Tensor:
        """Per-token cross-entropy of ``mb`` (waits for the barrier after S); the same on every rank."""
        return vs.loss_of(self._mb[mb].merged.wait())

    # -- T and the reduction after it ------------------------------------------------------------
    def t_pass(self, mb: int, dloss: Tensor) -> None:
        """Pass T: accumulate ∇W of the shard; naive/alg1 issue the SUM of the partial ∇X."""
        st = self._mb[mb]
        merged = st.merged.wait()
        input_grad = self.algorithm != "alg2"
        gw, gx = vs.t_pass(
            st.x,
            self.weight.detach(),
            st.labels,
            self.start,
            self.valid,
            st.s,
            merged,
            dloss.reshape(-1),
            input_grad=input_grad,
            chunk=self.chunk,
        )
        _accumulate(self.weight, gw)
        st.s = None
        st.extra["t_done"] = True
        if input_grad:
            work = dist.all_reduce(gx, group=self.group.grads, async_op=True)
            st.grad_x = Pending(work, lambda: gx)
        else:
            st.extra["dloss"] = dloss.reshape(-1)
        self._release(mb)

    def input_grad(self, mb: int, dloss: Tensor | None = None) -> Tensor:
        """∇X of ``mb`` ([tokens, h], the last stage needs it); waits for the reduction. Also completes
        the reduction on ranks that do not need the value (call it on every rank, in microbatch order).
        Algorithm 2 applies the per-token loss gradient here: ``dloss``, or the one T was given (the
        last stage's backward may run before T)."""
        st = self._mb[mb]
        if self.algorithm == "alg2":
            st.merged.wait()  # the merge issues the SUM of ∇X (the reduction thread may be doing it)
        grad = st.grad_x.wait()
        if self.algorithm == "alg2":
            scale = dloss if dloss is not None else st.extra["dloss"]
            grad = grad * scale.reshape(-1).unsqueeze(1)
        st.extra["grad_taken"] = True
        self._release(mb)
        return grad

    def _release(self, mb: int) -> None:
        st = self._mb[mb]
        if st.extra.get("t_done") and st.extra.get("grad_taken"):
            del self._mb[mb]
