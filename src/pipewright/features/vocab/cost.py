"""Cost of vocabulary parallelism and of its baselines (pure Python; no torch).

Per microbatch of b sequences of length s, hidden h, vocabulary V padded to a multiple of P = p·t and
V_p = V/P rows per device, element size e (bf16: 2), the output layer on one device costs

- pass S: 2·b·s·h·V_p FLOPs (the logits); Algorithm 2 adds 2·b·s·h·V_p more (softmax·W_q, half of ∇x);
- pass T: Algorithm 1 and naive 4·b·s·h·V_p (∇W_q and ∇x), Algorithm 2 2·b·s·h·V_p (∇W_q); the chunked
  variant recomputes the logits in T, +2·b·s·h·V_p (not model FLOPs);
- both touch the fp32 [b·s × V_p] softmax: S writes logits, exponentials and the softmax (≈ 3 passes of
  4·b·s·V_p bytes), T reads it and writes dZ (≈ 2 passes), at the device's memory bandwidth;
- the naive algorithm's S is Algorithm 1's S cut at its MAX all-reduce: ``VSM`` the logits and their
  row maxima (2·b·s·h·V_p FLOPs, 1 pass), ``VS`` the exponentials, Σexp, target logit and softmax
  (2 passes, no matmul) — the same work as Algorithm 1's S, with a rendezvous in the middle;

so model FLOPs are 6·b·s·h·V over the P devices, as on the last stage of the naive placement. The input
layer's lookup and its backward scatter move b·s·h·e bytes each. Communication over the p·t devices:
the broadcast of X (b·s·h·e), the barrier after S (all-gather of 3·b·s fp32 statistics; Algorithm 2 also
the SUM of the rescaled ∇x, b·s·h·e; naive: the SUM all-reduce of Σexp and the target logit, 2·b·s fp32,
after the MAX all-reduce of the row maxima, b·s fp32), the SUM of ∇x after T (Algorithm 1, naive), the
SUM of the embedding lookups to stage 0 and the broadcast of its gradient (b·s·h·e each).

Memory: parameters 2·V_p·h per device (embedding + output); S (naive: from ``VSM`` on) holds X
(b·s·h·e, except on the last stage, which has it anyway), the softmax (4·b·s·V_p, not in the chunked
variant) and in Algorithm 2 the fp32 partial ∇x (4·b·s·h) until T.

The transformer layers come from :class:`~pipewright.cost.transformer.TransformerCost` built without
the vocabulary layers (V = 0 there). Baselines: :func:`naive_cost` (embedding on the first stage,
output and loss on the last) and :func:`redistribute_cost` (the layers-per-stage layout that minimizes
the slowest stage's F + B, the first and last stages taking fewer layers).

The simulator asks the CommModel for each collective with its op and group; :class:`VocabComm` prices
the vocabulary groups (``vocab_*``) over the p·t devices and passes every other group to the
transformer cost's communication model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from pipewright.cost.comm import Mesh
from pipewright.cost.transformer import DTYPE_BYTES, TransformerCost
from pipewright.errors import ConfigError
from pipewright.features.vocab.kinds import (
    ALGORITHMS,
    COLLECTIVE_KINDS,
    GROUPS,
    VC0,
    VCM,
    VEB,
    VEF,
    VS,
    VSM,
    VT,
)
from pipewright.ir import Action, B, F, Schedule
from pipewright.models.spec import ModelSpec

#: the output-layer passes (FLOPs, softmax traffic, memory) and every vocabulary compute kind
_OUTPUT_KINDS = (VSM, VS, VT)
_COMPUTE = (VSM, VS, VT, VEF, VEB)


def padded_vocab(vocab: int, shards: int) -> int:
    """V rounded up to a multiple of p·t (the same as :func:`.shard.padded_vocab`, without torch)."""
    return -(-vocab // shards) * shards


def _without_vocab(spec: ModelSpec) -> ModelSpec:
    return replace(spec, vocab=0)


@dataclass(frozen=True, eq=False)
class VocabCost:
    """:class:`~pipewright.cost.base.CostModel` of a schedule with the vocabulary actions inserted.

    ``inner``: the transformer layers (a TransformerCost of the same spec with V = 0); ``algorithm``:
    naive, alg1 or alg2; ``chunk``: tokens per chunk of the chunked output layer (None: keep the softmax).
    """

    spec: ModelSpec
    inner: TransformerCost
    algorithm: str = "alg2"
    chunk: int | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def shards(self) -> int:
        return self.inner.mesh.pp * self.inner.mesh.tp

    @property
    def rows(self) -> int:
        """V_p: vocabulary rows per device."""
        return padded_vocab(self.spec.vocab, self.shards) // self.shards

    @property
    def _tokens(self) -> int:
        return self.inner.microbatch * self.spec.seq_len

    @property
    def _esize(self) -> int:
        return DTYPE_BYTES[self.inner.dtype]

    # -- per-kind numbers (one device, one microbatch) -----------------------------------------------
    def vocab_flops(self, kind: str) -> tuple[float, float]:
        """(executed, model) FLOPs of a vocabulary compute kind on one device."""
        one = 2.0 * self._tokens * self.spec.hidden * self.rows
        fused = self.algorithm == "alg2"
        naive = self.algorithm == "naive"
        if kind == VSM:  # the naive algorithm's logits
            return (one, one) if naive else (0.0, 0.0)
        if kind == VS:  # naive: exponentials and sums, no matmul; alg2: also softmax·W_q
            s = 0.0 if naive else (2 * one if fused else one)
            return s, s
        if kind == VT:
            model = one if fused else 2 * one
            return model + (one if self.chunk else 0.0), model
        return 0.0, 0.0

    def vocab_traffic(self, kind: str) -> float:
        """Bytes the memory-bound kernels of a vocabulary kind move on one device."""
        if kind in _OUTPUT_KINDS:
            return self._softmax_passes(kind) * 4.0 * self._tokens * self.rows
        if kind in (VEF, VEB):
            return 2.0 * self._tokens * self.spec.hidden * self._esize
        return 0.0

    def _softmax_passes(self, kind: str) -> float:
        """fp32 [b·s × V_p] passes: S 3 (naive: VSM 1 + VS 2), T 2."""
        if kind == VS and self.algorithm == "naive":
            return 2.0
        return {VSM: 1.0, VS: 3.0, VT: 2.0}[kind]

    def collective_bytes(self, kind: str) -> tuple[str, float]:
        """(collective op, bytes per device) of a vocabulary collective kind."""
        act = float(self._tokens * self.spec.hidden * self._esize)
        if kind == VCM:
            return "all_reduce", 4.0 * self._tokens  # the row maxima
        if kind == VC0 and self.algorithm == "naive":
            return "all_reduce", 8.0 * self._tokens  # Σexp and the target logit
        if kind == VC0:
            return "all_gather", 12.0 * self._tokens + (act if self.algorithm == "alg2" else 0.0)
        if kind not in GROUPS:
            return "all_reduce", 0.0
        op = GROUPS[kind][0]  # X, ∇X, the embedding output and its gradient: b·s·h elements each
        return ("broadcast" if op == "reduce" else op), act  # a reduce takes a broadcast's time

    def collective_time(self, kind: str, rank: int = 0) -> float:
        """Seconds of a vocabulary collective over the p·t devices."""
        op, nbytes = self.collective_bytes(kind)
        if op == "all_gather":  # statistics all-gather + (alg2) the ∇x all-reduce
            stats = 12.0 * self._tokens * self.shards
            t = self._group_time("all_gather", stats)
            extra = nbytes - 12.0 * self._tokens
            return t + (self._group_time("all_reduce", extra) if extra > 0 else 0.0)
        return self._group_time(op, nbytes)

    def _group_time(self, op: str, nbytes: float) -> float:
        comm = self.inner.comm
        mesh = self.inner.mesh
        devices = [
            comm.topology.devices[mesh.global_rank(r, 0, q)] for r in range(mesh.pp) for q in range(mesh.tp)
        ]
        return comm.topology.collective_time(op, devices, nbytes / self.inner.efficiency.comm)

    def collective_seconds(self, group: str) -> float:
        """Seconds of the vocabulary collective of a named group (``vocab_x`` …)."""
        kind = next(k for k, (_, g) in GROUPS.items() if g == group)
        key = ("coll", kind)
        if key not in self._cache:
            self._cache[key] = self.collective_time(kind)
        return self._cache[key]

    def memory_of(self, kind: str, rank: int, schedule: Schedule) -> float:
        """Activation bytes S holds until T on ``rank`` (S adds — naive: its first part VSM, which
        writes the logits —, T frees)."""
        hold = VSM if self.algorithm == "naive" else VS
        if kind not in (hold, VT):
            return 0.0
        keep = 0.0 if self.chunk else 4.0 * self._tokens * self.rows
        if self.algorithm == "alg2":
            keep += 4.0 * self._tokens * self.spec.hidden
        if rank != schedule.rank_of(schedule.num_stages - 1):
            keep += self._tokens * self.spec.hidden * self._esize
        return keep if kind == hold else -keep

    def vocab_parameters(self) -> float:
        """Parameters of the vocabulary layers on one device: 2·V_p·h."""
        return 2.0 * self.rows * self.spec.hidden

    # -- CostModel -----------------------------------------------------------------------------------
    def compute_time(self, action: Action, schedule: Schedule) -> float:
        kind = action.kind
        if kind not in _COMPUTE:
            return self.inner.compute_time(action, schedule)
        key = ("time", kind)
        hit = self._cache.get(key)
        if hit is None:
            gpu = self.inner.topology.accelerator(self.inner.comm.device(0))
            executed, _ = self.vocab_flops(kind)
            hit = executed / (gpu.peak(self.inner.dtype) * self.inner.efficiency.gemm)
            hit += self.vocab_traffic(kind) / gpu.memory_bandwidth
            self._cache[key] = hit
        return hit

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind in COLLECTIVE_KINDS:
            return self.collective_bytes(action.kind)[1]
        return self.inner.message_bytes(action, schedule)

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind in _OUTPUT_KINDS:
            return self.memory_of(action.kind, schedule.rank_of(action.stage), schedule)
        return self.inner.activation_bytes(action, schedule)

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return self.inner.static_bytes(rank, schedule) + self.vocab_parameters() * self.inner.bytes_per_param

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """The inner model's recomputation transient for its layers' actions; none for vocabulary passes."""
        transient = getattr(self.inner, "transient_bytes", None)
        if transient is None or action.kind in _OUTPUT_KINDS:
            return 0.0
        return transient(action, schedule)

    def flops(self, action: Action, schedule: Schedule) -> float:
        if action.kind in _OUTPUT_KINDS:
            return self.vocab_flops(action.kind)[0]
        return self.inner.flops(action, schedule)

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        if action.kind in _OUTPUT_KINDS:
            return self.vocab_flops(action.kind)[1]
        return self.inner.model_flops(action, schedule)


@dataclass(frozen=True)
class VocabComm:
    """The simulator's CommModel: the transformer cost's, with the vocabulary collectives (their named
    ``vocab_*`` groups) priced over the p·t devices by :meth:`VocabCost.collective_time`."""

    cost: VocabCost

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return self.cost.inner.comm.p2p_time(src, dst, nbytes)

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        if group.startswith("vocab_"):
            return self.cost.collective_seconds(group)
        return self.cost.inner.comm.collective_time(kind, rank, nbytes, group, members)


def vocab_cost(
    spec: ModelSpec,
    *,
    pp: int,
    tp: int = 1,
    microbatch: int = 1,
    gpu: str = "a100-80gb",
    dtype: str = "bf16",
    algorithm: str = "alg2",
    chunk: int | None = None,
    **transformer: object,
) -> VocabCost:
    """The vocabulary-parallel cost of ``spec`` on a pp × tp mesh (dp = 1)."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"--vocab-parallel {algorithm}: the cost model knows {', '.join(ALGORITHMS)}")
    if chunk is not None and algorithm == "naive":
        raise ConfigError("the chunked output layer needs --vocab-parallel alg1 or alg2, not naive")
    inner = TransformerCost(
        _without_vocab(spec),
        microbatch=microbatch,
        gpu=gpu,
        dtype=dtype,
        mesh=Mesh(tp=tp, pp=pp),
        **transformer,
    )
    return VocabCost(spec, inner, algorithm, chunk)


def naive_cost(
    spec: ModelSpec, *, pp: int, tp: int = 1, layout: tuple[int, ...] | None = None, **kw
) -> TransformerCost:
    """The naive placement: embedding on the first stage, output layer and loss on the last."""
    return TransformerCost(spec, mesh=Mesh(tp=tp, pp=pp), layout=layout, **kw)


def stage_times(cost: TransformerCost, schedule: Schedule) -> list[float]:
    """F + B seconds of one microbatch on each stage."""
    return [
        cost.compute_time(Action(s, F, 0), schedule) + cost.compute_time(Action(s, B, 0), schedule)
        for s in range(schedule.num_stages)
    ]


def redistribute_layout(
    spec: ModelSpec, schedule: Schedule, *, pp: int, tp: int = 1, **kw
) -> tuple[int, ...]:
    """Layers per stage that minimize the slowest stage's F + B when the first stage keeps the embedding
    and the last the output layer: the first and last take a and c layers, the others share the rest
    evenly (the extra layers on the earliest middle stages). Ties: the first found (fewest layers on
    the first stage)."""
    n, layers = schedule.num_stages, spec.layers
    if n < 3:
        raise ConfigError("layer redistribution needs at least 3 pipeline stages")
    best: tuple[float, tuple[int, ...]] | None = None
    most = -(-layers // n)  # the first and last stages never take more than a uniform share
    for a, c in itertools.product(range(most + 1), repeat=2):
        middle = layers - a - c
        if middle < n - 2:
            continue
        q, r = divmod(middle, n - 2)
        layout = (a, *(q + (i < r) for i in range(n - 2)), c)
        if min(layout[1:-1]) < 1:
            continue
        worst = max(stage_times(naive_cost(spec, pp=pp, tp=tp, layout=layout, **kw), schedule))
        if best is None or worst < best[0] * (1 - 1e-12):
            best = (worst, layout)
    assert best is not None
    return best[1]


def redistribute_cost(spec: ModelSpec, schedule: Schedule, *, pp: int, tp: int = 1, **kw) -> TransformerCost:
    """The layer-redistribution baseline on ``schedule``'s stages."""
    layout = redistribute_layout(spec, schedule, pp=pp, tp=tp, **kw)
    return naive_cost(spec, pp=pp, tp=tp, layout=layout, **kw)


def rank_balance(cost, schedule: Schedule) -> list[dict]:
    """Per rank: parameter bytes (static) and compute seconds of one microbatch (every compute action of
    microbatch 0 on the rank) — the balance report ``simulate`` prints."""
    out = []
    for rank in range(schedule.num_ranks):
        busy = sum(
            cost.compute_time(a, schedule)
            for a in schedule.actions[rank]
            if a.microbatch == 0 and schedule.kinds[a.kind].compute
        )
        out.append({"rank": rank, "static_bytes": cost.static_bytes(rank, schedule), "compute_s": busy})
    return out
