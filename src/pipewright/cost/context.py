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
  - ``pipewright``: this package's runtime (``runtime/cp/ring.py``) keeps the diagonal block's dK/dV
    home and sends every other accumulator c − 1 times, in fp32: (c − 1)·KV·e + (c − 1)·KV·4. Each
    accumulator transfer is waited after the next block's computation (double buffering), except the
    last, which brings the rank's own accumulator home after its last block: KV·4 bytes per layer and
    backward waited with nothing to overlap (:func:`ring_waited_bytes_per_layer`).

  The default is Transformer Engine's because the cost model describes GPU runs, where Megatron-LM and
  its descendants run that ring; pipewright's own ring is a CPU reference (gloo) whose fp32 accumulator
  keeps the gradients equal to a single process.

The transfers overlap the block computations, so only what exceeds the attention core's time is exposed
(and the waited bytes, which nothing overlaps).
Everything else in the layer (GEMMs, norms, activations) is per token and divides by c; the attention
FLOPs divide by c too (the balanced split). Gradients are reduced over the dp × cp replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipewright.cost.attention_kinds import attention_of
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec


@dataclass(frozen=True)
class RingBackward:
    """The dK/dV accumulator of a ring's backward: bytes per element (0: the activations') and whether
    its last transfer is waited after the last block, with no computation behind it."""

    grad_element_bytes: int = 0
    waits_last: bool = False


#: ring implementations by name (module docstring)
RING_BACKWARDS: Mapping[str, RingBackward] = MappingProxyType(
    {
        "transformer-engine": RingBackward(),
        "pipewright": RingBackward(grad_element_bytes=4, waits_last=True),
    }
)


def check_context_parallel(spec: ModelSpec, cp: int) -> None:
    """One-line ConfigError unless cp ≥ 1 splits the sequence into 2·cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"--cp must be at least 1 (got {cp})")
    if cp > 1 and spec.seq_len % (2 * cp):
        raise ConfigError(
            f"--cp {cp} needs a sequence length divisible by 2 × cp = {2 * cp} (got {spec.seq_len}); "
            "ring attention splits each sequence into 2·cp chunks"
        )


def _ring(ring: str) -> RingBackward:
    if ring not in RING_BACKWARDS:
        raise ConfigError(f"unknown ring {ring!r}; choose one of: {', '.join(RING_BACKWARDS)}")
    return RING_BACKWARDS[ring]


def _block(spec: ModelSpec, b: int, cp: int, t: int) -> float:
    """Elements of one key/value block, KV = b·(s/c)·w/t (module docstring)."""
    return b * (spec.seq_len / cp) * attention_of(spec).ring_width(spec) / t


def ring_bytes_per_layer(
    spec: ModelSpec, b: int, cp: int, t: int, element_bytes: int, ring: str = "transformer-engine"
) -> dict[str, float]:
    """Bytes one rank sends around the ring per layer and microbatch, per kind (module docstring):
    forward (c − 1)·KV·e, backward that plus (c − 1)·KV·(the accumulator's bytes per element)."""
    backward = _ring(ring)
    if cp <= 1:
        return {F: 0.0, I: 0.0, W: 0.0, B: 0.0}
    block = _block(spec, b, cp, t)
    fwd = (cp - 1) * block * element_bytes
    grads = (cp - 1) * block * (backward.grad_element_bytes or element_bytes)
    return {F: fwd, I: fwd + grads, W: 0.0, B: fwd + grads}


def ring_waited_bytes_per_layer(
    spec: ModelSpec, b: int, cp: int, t: int, element_bytes: int, ring: str = "transformer-engine"
) -> dict[str, float]:
    """Of :func:`ring_bytes_per_layer`, the bytes waited with no block computation behind them: one
    accumulator per backward for a ring that waits its last (module docstring), else none."""
    backward = _ring(ring)
    if cp <= 1 or not backward.waits_last:
        return {F: 0.0, I: 0.0, W: 0.0, B: 0.0}
    last = _block(spec, b, cp, t) * (backward.grad_element_bytes or element_bytes)
    return {F: 0.0, I: last, W: 0.0, B: last}
