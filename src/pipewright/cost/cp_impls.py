"""Context-parallel attention as each implementation executes it (``--cp-comm NAME``; sources and line
references: docs/context-parallelism.md, "Implementations priced").

For one layer and microbatch on one rank of a cp group of c ranks, with b sequences of s tokens, t
tensor-parallel ranks and e bytes per activation element, a key/value block is
E_kv = b·(s/c)·w/t elements (w: key plus value width per token of what the implementation sends) and the
attention output O = b·(s/c)·a·d/t elements. An implementation prices each pass (forward; backward)
as a :class:`CPPass`: the bytes it sends, the seconds its communication waits with no attention
behind it (``exposed_s``), the memory-bound bytes it adds (copies, merges, accumulators;
``traffic_bytes``, priced at the memory bandwidth), its attention kernel calls and its K/V buffers.
The attention core's time A of the pass is the cost model's (every implementation below computes the
causal pairs once: balanced, so each of the c kernel calls of a ring does A/c).

- ``transformer-engine`` (Megatron-LM's default) and ``pipewright`` (this package's runtime): the
  p2p ring of :mod:`pipewright.cost.context_parallel`, all transfers of a kind priced as one
  all-gather hidden behind that kind's whole attention (unchanged from
  :func:`~pipewright.cost.context_parallel.ring_bytes_per_layer`).
- ``torch-allgather`` / ``torch-alltoall``: PyTorch's ``context_parallel``
  (torch/distributed/tensor/experimental/_attention.py) with that rotate method, as torchtitan's Llama
  calls it (``repeat_kv`` before SDPA: the K/V carry all a query heads, w = 2·a·d). Head-tail load
  balancing (2·c chunks); one SDPA call per step (the diagonal block causal, then half blocks: A/c
  each). Forward: one all-gather of the c blocks posted before the diagonal block and waited after it
  (allgather), or one neighbour permute per step waited at the next step (alltoall). Backward: the K/V
  rotate again; the fp32 dK/dV accumulators travel by permute c times on the same process group (NCCL
  runs its transfers in posting order, :func:`run_streams`), each waited after the next step's kernel,
  the last after the loop. Memory-bound bytes on rank c − 1 (whose later steps all merge the full
  output): :func:`torch_forward_traffic`, :func:`torch_backward_traffic` (eager PyTorch op by op;
  ``fused``: torch.compile's fused pointwise chains, the unused concatenations dropped).
- ``llama3-allgather``: Llama 3 §3.3.2: 2·c chunks, K/V all-gathered (GQA heads, w = 2·g·d) before the
  attention with nothing to overlap (forward exposed: the all-gather), the attention for the local
  queries; the backward's dK/dV reduce-scattered (the all-gather's adjoint, its dtype assumed the
  activations'), exposed. Kernel calls per pass not stated (None).

Full recomputation re-runs the forward's exchange inside the backward: added to I and B for the
implementations priced pass by pass (:class:`PassImpl`); the p2p rings keep their earlier pricing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pipewright.cost.attention_kinds import attention_of
from pipewright.ir import F, W
from pipewright.models.spec import ModelSpec
from pipewright.named_registry import Registry

#: bytes per element of the fp32 merge and the dK/dV accumulators
FP32 = 4
#: bytes per output element of one full-output log-sum-exp merge step (fp32, ``_SDPAMerger._merge_one``):
#: the block output cast (e read, 4 written) is counted apart; ``out − block_out`` 12, ``sigmoid(·) * ·``
#: 8, ``out − ·`` 12 (the log-sum-exp terms are O/d elements, left out)
MERGE_STEP = 12 + 8 + 12


@dataclass(frozen=True)
class CPShape:
    """One layer's context-parallel attention on one rank: ``b`` sequences, ``cp`` ranks, ``t``
    tensor-parallel ranks, ``element_bytes`` e per activation element; ``fused``: pointwise chains run
    as one kernel each (torch.compile's Inductor; the cost model's ``kernels`` other than eager)."""

    spec: ModelSpec
    b: int
    cp: int
    t: int
    element_bytes: int
    fused: bool = False

    def block(self, width: float) -> float:
        """Elements of one rank's K/V block of ``width`` elements per token: b·(s/c)·w/t."""
        return self.b * (self.spec.seq_len / self.cp) * width / self.t

    @property
    def gqa_width(self) -> float:
        """Key plus value elements per token as the attention kind projects them (2·g·d for MHA)."""
        return attention_of(self.spec).ring_width(self.spec)

    @property
    def repeated_width(self) -> float:
        """Key plus value elements per token after ``repeat_kv`` to the a query heads: 2·a·d (MHA)."""
        spec = self.spec
        if spec.attention_kind != "mha":
            return self.gqa_width
        return 2 * spec.heads * spec.head_dim

    @property
    def output(self) -> float:
        """Elements of the attention output (and of Q) on this rank: b·(s/c)·a·d/t."""
        return self.block(self.spec.heads * self.spec.head_dim)


@dataclass(frozen=True)
class CPComm:
    """Seconds of the cp group's transfers: ``gather``/``scatter`` price an all-gather/reduce-scatter of
    a total number of bytes over the ``cp`` ranks (the cost model's collective prices)."""

    gather: Callable[[float], float]
    scatter: Callable[[float], float]
    cp: int

    def all_gather(self, block_bytes: float) -> float:
        """Gather c blocks of ``block_bytes`` each."""
        return self.gather(self.cp * block_bytes)

    def reduce_scatter(self, block_bytes: float) -> float:
        """Reduce-scatter c blocks of ``block_bytes`` each."""
        return self.scatter(self.cp * block_bytes)

    def step(self, block_bytes: float) -> float:
        """One neighbour permute of a block: one step of a ring all-gather, AG(c blocks)/(c − 1)."""
        return self.all_gather(block_bytes) / (self.cp - 1)


@dataclass(frozen=True)
class CPPass:
    """One pass of one layer's context-parallel attention on one rank (module docstring)."""

    sent_bytes: float
    comm_s: float
    exposed_s: float
    traffic_bytes: float = 0.0
    kernel_calls: int | None = None
    buffer_bytes: float = 0.0

    def seconds(self, bandwidth: float) -> float:
        """What the pass adds to the attention core: exposed communication + traffic / bandwidth."""
        return self.exposed_s + self.traffic_bytes / bandwidth

    def __add__(self, other: CPPass) -> CPPass:
        """Two passes one after the other (a recomputed forward and a backward): sums, the larger
        buffer, kernel calls None where either is unstated."""
        known = self.kernel_calls is not None and other.kernel_calls is not None
        calls = self.kernel_calls + other.kernel_calls if known else None
        return CPPass(
            self.sent_bytes + other.sent_bytes,
            self.comm_s + other.comm_s,
            self.exposed_s + other.exposed_s,
            self.traffic_bytes + other.traffic_bytes,
            calls,
            max(self.buffer_bytes, other.buffer_bytes),
        )


Op = tuple  # ("compute", s) | ("post", name, s) | ("wait", name)


def run_streams(program: Sequence[Op]) -> tuple[float, float]:
    """(end, compute) seconds of ``program`` on one compute stream and one communication stream whose
    transfers run in posting order (one NCCL communicator): ``post`` starts a transfer when both the
    program has reached it and the stream is free, ``wait`` blocks until it is done."""
    now = free = busy = 0.0
    done: dict[str, float] = {}
    for op in program:
        if op[0] == "compute":
            now += op[1]
            busy += op[1]
        elif op[0] == "post":
            free = done[op[1]] = max(now, free) + op[2]
        else:
            now = max(now, done.pop(op[1]))
    return now, busy


@dataclass(frozen=True)
class CPImpl(ABC):
    """A registered implementation (``name``, a one-line ``summary``): :meth:`kind_pass` prices one
    action kind of one layer given the shape, the group's transfer prices, the kind's attention seconds
    and the forward's, and whether the backward re-runs the forward (full recomputation)."""

    name: str
    summary: str

    @abstractmethod
    def kind_pass(self, x: CPShape, comm: CPComm, kind: str, attn: float, fwd: float, redo: bool) -> CPPass:
        """One layer's pass of ``kind`` (F, I, W or B) on one rank."""


@dataclass(frozen=True)
class RingBackward:
    """The dK/dV accumulator of a p2p ring's backward: bytes per element (0: the activations') and
    whether its last transfer is waited after the last block, with no computation behind it."""

    grad_element_bytes: int = 0
    waits_last: bool = False


@dataclass(frozen=True)
class RingImpl(CPImpl):
    """A p2p ring (:mod:`pipewright.cost.context_parallel`): a kind's transfers priced as one all-gather of
    their bytes, hidden behind the kind's whole attention; the recomputed forward's exchange is not
    added (the ring's transfers of I are its backward's)."""

    backward: RingBackward = RingBackward()

    def ring_bytes(self, x: CPShape, kind: str) -> float:
        """Bytes one rank sends per layer: forward (c − 1)·KV·e, backward that plus (c − 1)·KV·(the
        accumulator's bytes per element), KV = b·(s/c)·w/t with the attention kind's w."""
        if x.cp <= 1 or kind == W:
            return 0.0
        block = x.block(x.gqa_width)
        fwd = (x.cp - 1) * block * x.element_bytes
        if kind == F:
            return fwd
        return fwd + (x.cp - 1) * block * (self.backward.grad_element_bytes or x.element_bytes)

    def kind_pass(self, x: CPShape, comm: CPComm, kind: str, attn: float, fwd: float, redo: bool) -> CPPass:
        sent = self.ring_bytes(x, kind)
        if not sent:
            return CPPass(0.0, 0.0, 0.0)
        seconds = comm.all_gather(sent / (x.cp - 1))
        block = x.block(x.gqa_width) * x.element_bytes
        return CPPass(sent, seconds, max(0.0, seconds - attn), 0.0, x.cp, 2 * block)


@dataclass(frozen=True)
class PassImpl(CPImpl):
    """An implementation priced pass by pass: ``forward``/``backward`` give one pass's
    :class:`CPPass` from the shape, the transfer prices and the pass's attention seconds; I and B
    add the recomputed forward under full recomputation."""

    forward: Callable[[CPShape, CPComm, float], CPPass]
    backward: Callable[[CPShape, CPComm, float], CPPass]

    def kind_pass(self, x: CPShape, comm: CPComm, kind: str, attn: float, fwd: float, redo: bool) -> CPPass:
        if x.cp <= 1 or kind == W:
            return CPPass(0.0, 0.0, 0.0)
        if kind == F:
            return self.forward(x, comm, attn)
        if redo:
            return self.backward(x, comm, attn - fwd) + self.forward(x, comm, fwd)
        return self.backward(x, comm, attn)


def _kv_copies(x: CPShape, gather: bool) -> float:
    """K and V made contiguous, then concatenated at every step but the last (2·E_kv·e each); under
    the all-gather rotate only the first concatenation feeds a transfer, so a compiled graph drops the
    others (dead code) while eager PyTorch runs them."""
    kv, e = x.block(x.repeated_width), x.element_bytes
    cats = 1 if gather and x.fused else x.cp - 1
    return 2 * kv * e * (1 + cats)


def torch_forward_traffic(x: CPShape, gather: bool = True) -> float:
    """Memory-bound bytes of PyTorch's ring forward on rank c − 1 (module docstring): K/V made
    contiguous, one ``torch.cat`` of K and V per step but the last, the merge (the first block's
    output cast to fp32, c − 1 full-output merges each with its cast (fused: one pass reading the fp32
    output and the block's, writing the fp32 output: 8 + e), the result cast back)."""
    c, e, o = x.cp, x.element_bytes, x.output
    copies = _kv_copies(x, gather)
    step = 2 * FP32 + e if x.fused else e + FP32 + MERGE_STEP
    merge = o * ((e + FP32) + (c - 1) * step + (FP32 + e))
    return copies + merge


def torch_backward_traffic(x: CPShape, gather: bool = True) -> float:
    """Memory-bound bytes of PyTorch's ring backward on rank c − 1 (all its later steps take the first
    half of the K/V): fp32 zeros for dQ, dK, dV; K/V made contiguous and concatenated per step but the
    last; step 0 adds its bf16 dK/dV and dQ into fp32 ((8 + e) each); each later step adds half a block
    into the received dK/dV and re-concatenates it (``_partial_update``: (8 + e)/2 + 8; fused one pass,
    8 + e/2) and adds dQ; every step concatenates dK and dV for the permute (8); the results cast back
    ((4 + e) each)."""
    c, e, kv, o = x.cp, x.element_bytes, x.block(x.repeated_width), x.output
    zeros = FP32 * (o + kv)
    copies = _kv_copies(x, gather)
    first = (8 + e) * (kv + o)
    partial = 8 + e / 2 if x.fused else (8 + e) / 2 + 8
    later = (c - 1) * (partial * kv + (8 + e) * o)
    sends = c * 8 * kv
    cast = (FP32 + e) * (o + kv)
    return zeros + copies + first + later + sends + cast


def _torch_program(c: int, a: float, kv: float, dkv: float | None, gather: bool) -> list[Op]:
    """The order of PyTorch's ring loop (module docstring): per step i, wait the K/V of the previous
    exchange, post the next, run the kernel (a seconds); backward (``dkv`` seconds per permute): wait
    the previous dK/dV and post this step's, the last waited after the loop."""
    prog: list[Op] = []
    for i in range(c):
        if i > 0 and (not gather or i == 1):
            prog.append(("wait", f"kv{0 if gather else i - 1}"))
        if i < c - 1 and (not gather or i == 0):
            prog.append(("post", f"kv{i}", kv))
        prog.append(("compute", a))
        if dkv is not None:
            if i > 0:
                prog.append(("wait", f"dkv{i - 1}"))
            prog.append(("post", f"dkv{i}", dkv))
    if dkv is not None:
        prog.append(("wait", f"dkv{c - 1}"))
    return prog


def _torch(gather: bool) -> tuple[Callable, Callable]:
    def exchange(x: CPShape, comm: CPComm) -> tuple[float, float, float]:
        block = x.block(x.repeated_width) * x.element_bytes
        seconds = comm.all_gather(block) if gather else comm.step(block)
        held = (x.cp if gather else 2) * block
        return block, seconds, held

    def forward(x: CPShape, comm: CPComm, attn: float) -> CPPass:
        block, kv, held = exchange(x, comm)
        end, busy = run_streams(_torch_program(x.cp, attn / x.cp, kv, None, gather))
        comm_s = kv * (1 if gather else x.cp - 1)
        return CPPass((x.cp - 1) * block, comm_s, end - busy, torch_forward_traffic(x, gather), x.cp, held)

    def backward(x: CPShape, comm: CPComm, attn: float) -> CPPass:
        block, kv, held = exchange(x, comm)
        grads = x.block(x.repeated_width) * FP32
        dkv = comm.step(grads)
        end, busy = run_streams(_torch_program(x.cp, attn / x.cp, kv, dkv, gather))
        comm_s = kv * (1 if gather else x.cp - 1) + x.cp * dkv
        sent = (x.cp - 1) * block + x.cp * grads
        return CPPass(sent, comm_s, end - busy, torch_backward_traffic(x, gather), x.cp, held + 2 * grads)

    return forward, backward


def _llama3_forward(x: CPShape, comm: CPComm, attn: float) -> CPPass:
    block = x.block(x.gqa_width) * x.element_bytes
    gather = comm.all_gather(block)
    return CPPass((x.cp - 1) * block, gather, gather, 0.0, None, x.cp * block)


def _llama3_backward(x: CPShape, comm: CPComm, attn: float) -> CPPass:
    block = x.block(x.gqa_width) * x.element_bytes
    scatter = comm.reduce_scatter(block)
    return CPPass((x.cp - 1) * block, scatter, scatter, 0.0, None, x.cp * block)


_REGISTRY: Registry[CPImpl] = Registry("context-parallel implementation", "--cp-comm")


def register(impl: CPImpl, *, override: bool = False) -> CPImpl:
    """Add ``impl`` (``override``: replace one of the same name)."""
    return _REGISTRY.add(impl.name, impl, override=override)


def names() -> tuple[str, ...]:
    """The registered implementations, the cost model's default first."""
    return _REGISTRY.names()


def cp_impl(name: str) -> CPImpl:
    """The registered implementation ``name``; a one-line ConfigError otherwise."""
    return _REGISTRY.get(name)


def registry() -> Mapping[str, CPImpl]:
    """The registered implementations by name (read-only)."""
    return _REGISTRY.view()


#: the p2p rings' backwards by implementation name (:mod:`pipewright.cost.context_parallel`)
RING_BACKWARDS: Mapping[str, RingBackward] = MappingProxyType(
    {"transformer-engine": RingBackward(), "pipewright": RingBackward(grad_element_bytes=4, waits_last=True)}
)

register(
    RingImpl(
        "transformer-engine",
        "Transformer Engine's p2p ring (Megatron-LM; the default): GQA K/V and dK/dV in the activation "
        "dtype, every transfer behind the attention",
        RING_BACKWARDS["transformer-engine"],
    )
)
register(
    RingImpl(
        "pipewright",
        "this package's runtime ring (runtime/parallel/cp/ring.py): GQA K/V, fp32 dK/dV",
        RING_BACKWARDS["pipewright"],
    )
)
register(
    PassImpl(
        "torch-allgather",
        "PyTorch context_parallel, rotate method allgather (torchtitan's default): repeated K/V "
        "all-gathered behind the diagonal block, fp32 dK/dV permuted",
        *_torch(gather=True),
    )
)
register(
    PassImpl(
        "torch-alltoall",
        "PyTorch context_parallel, rotate method alltoall: repeated K/V permuted to the next rank each "
        "step, fp32 dK/dV permuted",
        *_torch(gather=False),
    )
)
register(
    PassImpl(
        "llama3-allgather",
        "Llama 3's all-gather CP (paper section 3.3.2): GQA K/V all-gathered before the attention, "
        "exposed; dK/dV reduce-scattered, exposed",
        _llama3_forward,
        _llama3_backward,
    )
)
