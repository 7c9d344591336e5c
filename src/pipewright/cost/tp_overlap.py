"""How much tensor-parallel communication a layer's GEMMs hide (``--tp-comm-overlap MODE``).

The cost model sums a pass's tensor-parallel collectives (:mod:`pipewright.cost.transformer`: two
all-reduces of b·s·h per layer in F and in I; with sequence parallelism each is an all-gather before
a column-parallel GEMM plus a reduce-scatter after a row-parallel GEMM, each half the all-reduce's ring
time; and with sequence parallelism, in I, the backward's re-gather of each column-parallel block's
input for its weight gradient, an all-gather of b·s·h, which Megatron-LM hides under the block's
input-gradient GEMM whatever the mode: :func:`pass_exposed`). A registered mode says what of the rest
stays exposed:

- ``none``: all of it (no overlap).
- ``te`` (Transformer Engine's userbuffers overlap, Megatron-Core's ``--tp-comm-overlap``; the mode
  the bare flag names): every collective of a pass hidden behind all of the pass's GEMMs,
  max(0, C − G).
- ``async-tp`` (PyTorch's asynchronous TP, torchtitan's ``enable_async_tensor_parallel``: the Inductor
  pass ``torch/_inductor/fx_passes/micro_pipeline_tp.py``): the pass fuses an all-gather with the
  matmuls that take the gathered tensor as their left operand (``fused_all_gather_matmul``; it refuses
  a gather along the contraction dimension) and a reduce-scatter whose input is the output of one
  matmul with no other user (``fused_matmul_reduce_scatter``). Per layer that is, in the forward, all
  four: the all-gather with the QKV (and the MLP's up/gate) GEMMs, the reduce-scatter with the output
  projection (the MLP's down) GEMM. In the backward, the all-gather of the output gradient of each
  row-parallel layer feeds its input-gradient matmul dY·Wᵀ (fused), but the reduce-scatter of a
  column-parallel layer's input gradient reduces a sum of matmuls (dQ·Wqᵀ + dK·Wkᵀ + dV·Wvᵀ; the gate's
  and the up projection's) and is not fused: two of the backward's four collectives stay exposed,
  which is why PyTorch's write-up ("[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism
  in PyTorch", 2024) reports 20–29 % forward speedups and about 8 % end to end. A fused collective
  of time C is split t ways with its matmul (time M): t − 1 shard transfers overlap t − 1 of the t
  matmul pieces (the local shard's piece first for the all-gather; the first piece, with nothing yet
  to send, for the reduce-scatter), so max(0, C − M·(t − 1)/t) stays exposed. The collectives outside
  the layers (the embedding's, the loss's, the output layer's input gradient) stay exposed.

A rule reads one pass as a :class:`TpPass` (its collectives' times, its GEMMs' time, and, asked only
by ``async-tp``, each layer block's GEMM times), so the cost model (:func:`tp_exposed_time`) and the
planner's estimate (:mod:`pipewright.plan.costs`) price a mode with the same rule. A bare
``--tp-comm-overlap`` names the mode of the ``--framework`` priced
(:attr:`pipewright.cost.frameworks.Framework.tp_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipewright.cost.layer import layer_gemms
from pipewright.cost.sharding import exposed
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.named_registry import Registry

if TYPE_CHECKING:
    from pipewright.cost.transformer import TransformerCost

Shape = tuple[float, float, float]  # a GEMM's (m, n, k)
#: one layer block's GEMM seconds: (into: the matmuls fed by the block's all-gather, out: the matmul
#: whose output is reduce-scattered, out's input gradient dY·Wᵀ)
BlockTimes = tuple[float, float, float]


@dataclass(frozen=True)
class TpPass:
    """One pass of a chunk as an exposure rule reads it: ``kind`` (F, I, W or B), its tensor-parallel
    collectives' seconds in the chunk table's order (per layer the attention block's pair, then the
    MLP's, then the collectives outside the layers), its GEMMs' seconds ``gemm``, the chunk's
    ``layers``, the tensor-parallel size ``tp``, whether the backward re-runs the forward first
    (``full_recompute``), and ``blocks()``: the two blocks' :data:`BlockTimes` of one layer (called
    only by a rule that needs them)."""

    kind: str
    collectives: tuple[float, ...]
    gemm: float
    layers: int = 0
    tp: int = 1
    full_recompute: bool = False
    blocks: Callable[[], tuple[BlockTimes, ...]] = tuple
    sequence_parallel: bool = False
    #: the output layer's input-gradient GEMM seconds (tokens × h × V/t), on a chunk that holds it
    head: Callable[[], float] | None = None
    #: the multi-token-prediction modules' input-gradient GEMMs, per module its projection's
    #: (tokens × 2h × h/t) and its output layer's, each behind a re-gather after the head's
    mtp: tuple[Callable[[], float], ...] = ()

    def regathers(self) -> tuple[int, int]:
        """(start, stop) of the backward's re-gathers in ``collectives``: with sequence parallelism
        the chunk table puts each layer's two (one a block) after the layers' collectives (after the
        recomputed forward's too), then the output layer's one (``head``) and the MTP modules' two
        each (``mtp``); (0, 0) where there are none."""
        heads = (self.head is not None) + len(self.mtp)
        if (
            not self.sequence_parallel
            or self.tp == 1
            or self.kind not in (I, B)
            or not (self.layers or heads)
        ):
            return 0, 0
        start = 2 * self.layers * (2 if self.full_recompute else 1)
        return start, start + 2 * self.layers + heads


#: ``exposed_time(pass)`` → seconds of TP communication left
Exposure = Callable[[TpPass], float]


@dataclass(frozen=True)
class TpOverlap:
    """One ``--tp-comm-overlap`` mode: its name, what it models, and its exposed-time rule."""

    name: str
    doc: str
    exposed_time: Exposure


_REGISTRY: Registry[TpOverlap] = Registry("--tp-comm-overlap mode", "--tp-comm-overlap")
#: the mode ``tp_comm_overlap=True`` names where no framework is given (the default framework's)
DEFAULT_MODE = "te"


def register(mode: TpOverlap) -> TpOverlap:
    """Add ``mode`` to the registry (a name may be registered once)."""
    return _REGISTRY.add(mode.name, mode)


def modes() -> Mapping[str, TpOverlap]:
    """The registered modes by name."""
    return _REGISTRY.view()


def resolve(value: bool | str | None, bare: str = DEFAULT_MODE) -> str:
    """The mode a flag value names: True (the bare flag) → ``bare``, False/None → ``none``; one-line
    error if unknown."""
    if value is True:
        value = bare
    if value is False or value is None:
        return "none"
    if value not in _REGISTRY:
        raise ConfigError(f"--tp-comm-overlap must be one of {', '.join(_REGISTRY.names())} (got {value!r})")
    return value


def chunk_tp_bytes(
    act: float, n: int, full: bool, first: bool, last: bool, loss: float, regather: bool
) -> dict[str, tuple[float, ...]]:
    """A chunk's tensor-parallel collectives per kind, in all-reduce bytes, in the order the exposure
    rules read them (:mod:`pipewright.cost.tp_overlap`): per layer two all-reduces of the b·s·h
    activation ``act`` in F and in I (I twice under ``full`` recomputation); with sequence parallelism
    (``regather``) then, in I, the two all-gathers of each layer's column-parallel inputs for the
    weight gradients (Megatron-LM's re-gather, ½ an all-reduce each) and, ``last``, the output
    layer's (its input re-gathered for its weight gradient); the embedding's all-reduce in F
    (``first``); the loss's three fp32 all-reduces of ``loss`` bytes in F and the output layer's input
    gradient in I (``last``)."""
    per_layer_ar = (act,) * 2 * n
    tp_bytes = {F: per_layer_ar, I: per_layer_ar * (2 if full else 1), W: ()}
    if regather:
        tp_bytes[I] += (act / 2,) * (2 * n + (1 if last else 0))
    if first:
        tp_bytes[F] += (act,)
    if last:
        tp_bytes[F] += (loss,) * 3
        tp_bytes[I] += (act,)
    return tp_bytes


def mtp_tp_bytes(
    act: float, loss: float, depth: int, regather: bool
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The tensor-parallel collectives of ``depth`` multi-token-prediction modules, in all-reduce
    bytes (an all-gather or a reduce-scatter of a buffer of B bytes: B/2), as Megatron-Core's
    ``MultiTokenPredictionLayer`` issues them on a microbatch (``act``: one b·s·h activation): (the
    forward's, the backward's re-gathers, the backward's others). Per module, with sequence
    parallelism (``regather``): forward, the embedding's reduce-scatter (act/2), the projection's
    all-gather of its [s, b, 2h] input (act), the all-gather of its h/t output columns
    (``gather_from_tensor_model_parallel_region``, act/2) and the loss's three fp32 all-reduces of
    ``loss`` bytes; backward, the re-gathers of the projection's input (act) and of the output layer's
    (act/2) for their weight gradients, the embedding's all-gather (act/2), the projection's
    input-gradient reduce-scatter (act), the all-gather of ``scatter_to_sequence_parallel_region``
    (act/2), and the output layer's input gradient (act: its forward all-gather and backward
    reduce-scatter, as the main head's in :func:`chunk_tp_bytes`). Without: forward, the embedding's
    all-reduce (act), the output columns' all-gather (act/2) and the loss's; backward, the projection's
    input-gradient all-reduce of [s, b, 2h] (2·act) and the output layer's (act)."""
    if regather:
        fwd: tuple[float, ...] = (act / 2, act, act / 2, loss, loss, loss)
        regathers: tuple[float, ...] = (act, act / 2)
        bwd: tuple[float, ...] = (act / 2, act, act / 2, act)
    else:
        fwd, regathers, bwd = (act, act / 2, loss, loss, loss), (), (2 * act, act)
    return fwd * depth, regathers * depth, bwd * depth


def layer_blocks(spec: ModelSpec, tokens: float, t: int) -> tuple[tuple[tuple[Shape, ...], Shape], ...]:
    """One layer's two blocks on ``tokens`` tokens at tensor-parallel size ``t``: (the GEMM shapes fed
    by the all-gather, the shape whose output is reduce-scattered), for the attention block (its QKV
    GEMMs, its output projection) and the MLP (up and gate, down)."""
    gemms = layer_gemms(spec, tokens, t)
    attn = len(gemms) - 2  # the attention kind's GEMMs, then the MLP's up (and gate) and down
    return ((tuple(gemms[: attn - 1]), gemms[attn - 1]), (tuple(gemms[attn : attn + 1]), gemms[attn + 1]))


def block_times(
    blocks: Sequence[tuple[Sequence[Shape], Shape]], seconds: Callable[[Sequence[Shape]], float]
) -> tuple[BlockTimes, ...]:
    """:data:`BlockTimes` of :func:`layer_blocks`' ``blocks``, each group priced by ``seconds``."""
    return tuple(
        (seconds(into), seconds((out,)), seconds(((out[0], out[2], out[1]),))) for into, out in blocks
    )


def pass_exposed(mode: TpOverlap, p: TpPass) -> float:
    """Seconds of ``p``'s tensor-parallel communication left exposed under ``mode``: ``mode``'s rule
    over the pass's collectives but the backward's re-gathers, and each re-gather as Megatron-LM issues
    it (``LinearWithGradAccumulationAndAsyncCommunication.backward`` with sequence parallelism: an
    asynchronous all-gather of the block's input, waited after the input-gradient GEMM dY·Wᵀ), exposed
    only by what exceeds that GEMM, max(0, A − D), whatever the mode; the output layer's behind its
    own input-gradient GEMM (``p.head``), an MTP module's projection's and output layer's behind
    theirs (``p.mtp``)."""
    start, stop = p.regathers()
    if start == stop:
        return mode.exposed_time(p)
    rest = replace(p, collectives=p.collectives[:start] + p.collectives[stop:], sequence_parallel=False)
    dgrads = [dgrad for _, _, dgrad in p.blocks() * p.layers] if p.layers else []
    if p.head is not None:
        dgrads.append(p.head())
    dgrads += [dgrad() for dgrad in p.mtp]
    hidden = sum(exposed(a, d) for a, d in zip(p.collectives[start:stop], dgrads, strict=True))
    return mode.exposed_time(rest) + hidden


def _none(p: TpPass) -> float:
    return sum(p.collectives)


def _te(p: TpPass) -> float:
    return exposed(sum(p.collectives), p.gemm)


def _async_tp(p: TpPass) -> float:
    """Per layer, each collective as the micro-pipeline pass fuses it (module docstring)."""
    n, t, collectives = p.layers, p.tp, p.collectives
    if p.kind not in (F, I, B) or n == 0 or t == 1:
        return sum(collectives)
    share = (t - 1) / t
    blocks = p.blocks() * n  # per layer: the attention block's pair of collectives, then the MLP's
    pairs = collectives[: 2 * n]
    forward = sum(
        exposed(c / 2, share * into) + exposed(c / 2, share * out)
        for c, (into, out, _) in zip(pairs, blocks, strict=False)
    )
    if p.kind == F:
        return forward + sum(collectives[2 * n :])
    backward = sum(
        exposed(c / 2, share * dgrad) + c / 2 for c, (_, _, dgrad) in zip(pairs, blocks, strict=False)
    )
    rest = collectives[2 * n :]
    if p.full_recompute:  # the recomputed forward's collectives come first
        backward += forward
        rest = collectives[4 * n :]
    return backward + sum(rest)


register(TpOverlap("none", "no overlap: every collective exposed", _none))
register(TpOverlap("te", "Transformer Engine: hidden behind all of the pass's GEMMs", _te))
register(TpOverlap("async-tp", "PyTorch's micro-pipeline pass: per collective as it fuses it", _async_tp))


def chunk_pass(
    cost: TransformerCost,
    chunk,
    kind: str,
    rank: int,
    gemm: float,
    collectives: tuple[float, ...] | None = None,
) -> TpPass:
    """``chunk``'s ``kind`` pass on pipeline rank ``rank`` of ``cost`` as a :class:`TpPass`: its
    collectives over the rank's tensor-parallel links (or the ``collectives`` seconds given) beside
    its GEMMs' ``gemm`` seconds."""
    if collectives is None:
        collectives = tuple(cost.comm.tp_all_reduce_time(rank, x) for x in chunk.tp_bytes[kind])

    def blocks() -> tuple[BlockTimes, ...]:
        acc = cost.topology.accelerator(cost.comm.device(rank))
        tokens = cost.microbatch * cost.spec.seq_len / cost.cp
        shapes = layer_blocks(cost.spec, tokens, cost.mesh.tp)
        return block_times(shapes, lambda group: cost.gemm_time([(m, n, k, 1) for m, n, k in group], acc))

    tokens, h, t = cost.microbatch * cost.spec.seq_len / cost.cp, cost.spec.hidden, cost.mesh.tp

    def dgrad(shape: Shape) -> Callable[[], float]:
        def seconds() -> float:
            return cost.gemm_time([(*shape, 1)], cost.topology.accelerator(cost.comm.device(rank)))

        return seconds

    full, sp = cost.recompute == "full", cost.sequence_parallel
    head = dgrad((tokens, h, cost.spec.vocab / t))
    ends = head if chunk.last else None
    depth = cost.spec.mtp_depth if chunk.last else 0
    mtp = (dgrad((tokens, 2 * h, h / t)), head) * depth
    return TpPass(kind, collectives, gemm, chunk.layers, t, full, blocks, sp, ends, mtp)


def tp_exposed_time(cost: TransformerCost, chunk, kind: str, rank: int, gemm: float) -> float:
    """Seconds of ``chunk``'s tensor-parallel communication in a ``kind`` pass left exposed by
    ``cost.tp_comm_overlap`` beside its GEMMs' ``gemm`` seconds (module docstring)."""
    tp_pass = chunk_pass(cost, chunk, kind, rank, gemm)
    return pass_exposed(_REGISTRY.get(resolve(cost.tp_comm_overlap)), tp_pass)
