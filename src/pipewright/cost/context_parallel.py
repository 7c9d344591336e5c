"""Context parallelism: ring attention over the cp group (Liu et al. 2023; Megatron-LM's CP).

Each of the c ranks of a context-parallel group holds s/c tokens of every sequence (2·c chunks, rank i
holding chunks i and 2c − 1 − i, so the causal work is balanced: the sequence must split into 2·c equal
chunks). Every layer's attention runs c steps; at each step a rank computes its queries against the
key/value block it holds and passes that block to its ring neighbour. One block is
KV = b·(s/c)·w/t elements, w the key plus value width per token of the attention kind
(:mod:`pipewright.cost.attention_kinds`: 2·g·d for multi-head attention, a·(d_qk + d_v) for MLA).

- Forward: c − 1 transfers of a block in the activation dtype (e bytes per element).
- Backward: the blocks go round again and each block's dK/dV accumulator travels after it, one step
  behind. How many transfers, in which dtype and how many of them wait with no block computation
  behind them depends on the implementation (``RING_BACKWARDS``):

  - ``transformer-engine`` (the cost model's default): Transformer Engine's ring, which Megatron-LM's
    context parallelism runs on GPUs, sends one buffer [K/V, dK/dV] in the activation dtype — the
    block alone at the first step, both in the middle steps, the accumulator alone at the last:
    (c − 1)·KV·e + (c − 1)·KV·e bytes, twice the forward's, each transfer behind a block computation.
  - ``pipewright``: this package's runtime (``runtime/parallel/cp/ring.py``) keeps the diagonal block's dK/dV
    home and sends every other accumulator c − 1 times, in fp32: (c − 1)·KV·e + (c − 1)·KV·4. Each
    accumulator transfer is waited after the next block's computation (double buffering), except the
    last, which brings the rank's own accumulator home after its last block: KV·4 bytes per layer and
    backward waited with nothing to overlap (:func:`ring_waited_bytes_per_layer`).

  The default is Transformer Engine's because the cost model describes GPU runs, where Megatron-LM and
  its descendants run that ring; pipewright's own ring is a CPU reference (gloo) whose fp32 accumulator
  keeps the gradients equal to a single process.

The transfers overlap the block computations, so only what exceeds the attention core's time is exposed
(and the waited bytes, which nothing overlaps).

Other implementations (PyTorch's ``context_parallel`` as torchtitan runs it, Llama 3's all-gather)
exchange other bytes in another order: :mod:`pipewright.cost.cp_impls` registers each by name; the cost
model's ``cp_comm`` (``--cp-comm``, a framework's default) picks one and :func:`cp_layer_seconds` adds
its exposed communication and memory-bound bytes per layer.
Everything else in the layer (GEMMs, norms, activations) is per token and divides by c; the attention
FLOPs divide by c too (the balanced split). Gradients are reduced over the dp × cp replicas.
"""

from __future__ import annotations

from typing import Any

from pipewright.cost.cp_impls import (
    RING_BACKWARDS,
    CPComm,
    CPShape,
    PassImpl,
    RingBackward,
    RingImpl,
    cp_impl,
    registry,
)
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec

__all__ = [
    "RING_BACKWARDS",
    "RingBackward",
    "check_context_parallel",
    "cp_buffer_bytes",
    "cp_layer_seconds",
    "cp_sent_bytes",
    "ring_bytes_per_layer",
    "ring_waited_bytes_per_layer",
]

#: the implementation the cost model prices by default (Megatron-LM's)
DEFAULT_CP_COMM = "transformer-engine"


def check_context_parallel(spec: ModelSpec, cp: int, cp_comm: str = DEFAULT_CP_COMM) -> None:
    """One-line ConfigError unless cp ≥ 1 splits the sequence into 2·cp equal chunks and ``cp_comm``
    names a registered implementation (:mod:`pipewright.cost.cp_impls`)."""
    if cp < 1:
        raise ConfigError(f"--cp must be at least 1 (got {cp})")
    if cp > 1 and spec.seq_len % (2 * cp):
        raise ConfigError(
            f"--cp {cp} needs a sequence length divisible by 2 × cp = {2 * cp} (got {spec.seq_len}); "
            "ring attention splits each sequence into 2·cp chunks"
        )
    cp_impl(cp_comm)


def _ring(ring: str) -> RingImpl:
    impl = registry().get(ring)
    if not isinstance(impl, RingImpl):
        raise ConfigError(f"unknown ring {ring!r}; choose one of: {', '.join(RING_BACKWARDS)}")
    return impl


def ring_bytes_per_layer(
    spec: ModelSpec, b: int, cp: int, t: int, element_bytes: int, ring: str = "transformer-engine"
) -> dict[str, float]:
    """Bytes one rank sends around the ring per layer and microbatch, per kind (module docstring):
    forward (c − 1)·KV·e, backward that plus (c − 1)·KV·(the accumulator's bytes per element)."""
    impl, shape = _ring(ring), CPShape(spec, b, cp, t, element_bytes)
    return {kind: impl.ring_bytes(shape, kind) for kind in (F, I, W, B)}


def ring_waited_bytes_per_layer(
    spec: ModelSpec, b: int, cp: int, t: int, element_bytes: int, ring: str = "transformer-engine"
) -> dict[str, float]:
    """Of :func:`ring_bytes_per_layer`, the bytes waited with no block computation behind them: one
    accumulator per backward for a ring that waits its last (module docstring), else none."""
    backward = _ring(ring).backward
    if cp <= 1 or not backward.waits_last:
        return {F: 0.0, I: 0.0, W: 0.0, B: 0.0}
    shape = CPShape(spec, b, cp, t, element_bytes)
    last = shape.block(shape.gqa_width) * (backward.grad_element_bytes or element_bytes)
    return {F: 0.0, I: last, W: 0.0, B: last}


def cp_layer_seconds(model: Any, kind: str, rank: int, attn: float, fwd: float, bandwidth: float) -> float:
    """Seconds one layer's context-parallel exchange adds to a ``kind`` action of pipeline rank
    ``rank`` of ``model`` (a :class:`~pipewright.cost.transformer.TransformerCost`): its
    ``cp_comm`` implementation's exposed communication and memory-bound bytes
    (:mod:`pipewright.cost.cp_impls`), given the kind's attention seconds ``attn`` per layer and the
    forward's ``fwd``."""
    comm = CPComm(
        lambda n: model.comm.collective_time("all_gather", rank, n, group="cp"),
        lambda n: model.comm.collective_time("reduce_scatter", rank, n, group="cp"),
        model.cp,
    )
    impl = cp_impl(getattr(model, "cp_comm", DEFAULT_CP_COMM))
    return impl.kind_pass(_shape(model), comm, kind, attn, fwd, model.recompute == "full").seconds(bandwidth)


def _shape(model: Any) -> CPShape:
    e, fused = model.activation_bytes_per_element, getattr(model, "kernels", "fused") != "eager"
    return CPShape(model.spec, model.microbatch, model.cp, model.mesh.tp, e, fused)


def cp_buffer_bytes(model: Any, kind: str) -> float:
    """The K/V (and dK/dV) buffers one layer's ``kind`` pass holds while it runs on a rank of ``model``,
    for the implementations priced pass by pass (PyTorch's gathered repeated K/V: c·E·e;
    :attr:`~pipewright.cost.cp_impls.CPPass.buffer_bytes`); 0 at cp 1 and for the p2p rings, whose two
    blocks in flight the memory model leaves out as before."""
    impl = cp_impl(getattr(model, "cp_comm", DEFAULT_CP_COMM))
    if model.cp <= 1 or not isinstance(impl, PassImpl):
        return 0.0
    free = CPComm(lambda n: 0.0, lambda n: 0.0, model.cp)
    return impl.kind_pass(_shape(model), free, kind, 0.0, 0.0, model.recompute == "full").buffer_bytes


def cp_sent_bytes(model: Any, kind: str) -> float:
    """Bytes one rank sends in one layer's ``kind`` pass of ``model``'s ``cp_comm`` implementation: the
    :attr:`~pipewright.cost.cp_impls.CPPass.sent_bytes` of the pass :func:`cp_layer_seconds` prices
    (0 at cp 1)."""
    if model.cp <= 1:
        return 0.0
    impl = cp_impl(getattr(model, "cp_comm", DEFAULT_CP_COMM))
    free = CPComm(lambda n: 0.0, lambda n: 0.0, model.cp)
    return impl.kind_pass(_shape(model), free, kind, 0.0, 0.0, model.recompute == "full").sent_bytes


def ring_gathered_bytes(passed: float, cp: int) -> float:
    """The all-gather size that prices a ring passing ``passed`` bytes: the ring moves c − 1 blocks,
    an all-gather of c blocks, so its gathered size is c/(c − 1) × the bytes passed."""
    return passed * cp / (cp - 1)
