"""How much tensor-parallel communication a layer's GEMMs hide (``--tp-comm-overlap MODE``).

The cost model sums a pass's tensor-parallel collectives (:mod:`pipewright.cost.transformer`: two
all-reduces of b·s·h per layer in F and in I; with sequence parallelism each is an all-gather before
a column-parallel GEMM plus a reduce-scatter after a row-parallel GEMM, each half the all-reduce's ring
time). A registered mode says what of it stays exposed:

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from pipewright.cost.layer import layer_gemms
from pipewright.cost.sharding import exposed
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I

if TYPE_CHECKING:
    from pipewright.cost.transformer import TransformerCost

#: ``exposed_time(cost, chunk, kind, rank, collectives, gemm)`` → seconds of TP communication left
Exposure = Callable[["TransformerCost", object, str, int, tuple[float, ...], float], float]


@dataclass(frozen=True)
class TpOverlap:
    """One ``--tp-comm-overlap`` mode: its name, what it models, and its exposed-time rule."""

    name: str
    doc: str
    exposed_time: Exposure


_REGISTRY: dict[str, TpOverlap] = {}
#: the mode a bare ``--tp-comm-overlap`` (or ``tp_comm_overlap=True``) names
DEFAULT_MODE = "te"


def register(mode: TpOverlap) -> TpOverlap:
    """Add ``mode`` to the registry (a name may be registered once)."""
    if mode.name in _REGISTRY:
        raise ConfigError(f"--tp-comm-overlap mode {mode.name!r} is already registered")
    _REGISTRY[mode.name] = mode
    return mode


def modes() -> Mapping[str, TpOverlap]:
    """The registered modes by name."""
    return MappingProxyType(_REGISTRY)


def resolve(value: bool | str | None) -> str:
    """The mode a flag value names: True → ``te``, False/None → ``none``; one-line error if unknown."""
    if value is True:
        return DEFAULT_MODE
    if value is False or value is None:
        return "none"
    if value not in _REGISTRY:
        raise ConfigError(f"--tp-comm-overlap must be one of {', '.join(_REGISTRY)} (got {value!r})")
    return value


def _none(cost, chunk, kind, rank, collectives, gemm) -> float:
    return sum(collectives)


def _te(cost, chunk, kind, rank, collectives, gemm) -> float:
    return exposed(sum(collectives), gemm)


def _async_tp(cost: TransformerCost, chunk, kind: str, rank: int, collectives, gemm: float) -> float:
    """Per layer, each collective as the micro-pipeline pass fuses it (module docstring)."""
    n, t = chunk.layers, cost.mesh.tp
    if kind not in (F, I, B) or n == 0 or t == 1:
        return sum(collectives)
    acc = cost.topology.accelerator(cost.comm.device(rank))
    tokens = cost.microbatch * cost.spec.seq_len / cost.cp
    gemms = layer_gemms(cost.spec, tokens, t)
    attn = len(gemms) - 2  # the attention kind's GEMMs, then the MLP's up (and gate) and down

    def time(group) -> float:
        return cost.gemm_time([(m, nn, k, 1) for m, nn, k in group], acc)

    def dgrad(group) -> float:
        return cost.gemm_time([(m, k, nn, 1) for m, nn, k in group], acc)

    share = (t - 1) / t
    # per layer: the attention block's pair of collectives, then the MLP's (pair time C each)
    blocks = ((gemms[: attn - 1], gemms[attn - 1 : attn]), (gemms[attn : attn + 1], gemms[attn + 1 :]))
    pairs = collectives[: 2 * n]
    forward = sum(
        exposed(c / 2, share * time(into)) + exposed(c / 2, share * time(out))
        for c, (into, out) in zip(pairs, blocks * n, strict=False)
    )
    if kind == F:
        return forward + sum(collectives[2 * n :])
    backward = sum(
        exposed(c / 2, share * dgrad(out)) + c / 2 for c, (_, out) in zip(pairs, blocks * n, strict=False)
    )
    rest = collectives[2 * n :]
    if cost.recompute == "full":  # the recomputed forward's collectives come first
        backward += forward
        rest = collectives[4 * n :]
    return backward + sum(rest)


register(TpOverlap("none", "no overlap: every collective exposed", _none))
register(TpOverlap("te", "Transformer Engine: hidden behind all of the pass's GEMMs", _te))
register(TpOverlap("async-tp", "PyTorch's micro-pipeline pass: per collective as it fuses it", _async_tp))


def tp_exposed_time(cost: TransformerCost, chunk, kind: str, rank: int, gemm: float) -> float:
    """Seconds of ``chunk``'s tensor-parallel communication in a ``kind`` pass left exposed by
    ``cost.tp_comm_overlap`` beside its GEMMs' ``gemm`` seconds (module docstring)."""
    collectives = tuple(cost.comm.tp_all_reduce_time(rank, x) for x in chunk.tp_bytes[kind])
    return _REGISTRY[resolve(cost.tp_comm_overlap)].exposed_time(cost, chunk, kind, rank, collectives, gemm)
