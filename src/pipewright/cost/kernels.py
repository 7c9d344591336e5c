"""How the memory-bound kernels run (``--kernels fused|eager|compiled``): bytes they move.

``fused`` (the default; Megatron-Core with Transformer Engine and Apex kernels): a layer's norms,
activations, rotary embedding, dropout and residual adds move κ (:attr:`Efficiency.memory_traffic`)
× the bytes a forward stores, the backward twice that, and the vocabulary-parallel cross-entropy is
one fused kernel (12 bytes per logit forward, 10 backward) that keeps one fp32 copy of the logits
(4 bytes per logit) — :mod:`pipewright.cost.transformer`.

``eager`` (PyTorch eager, as torchtitan's Llama runs it: ``models/norms.py`` RMSNorm,
``models/llama/model.py`` rotary embedding, ``repeat_kv``, SwiGLU and residual adds): every operator
is its own kernel that reads its inputs and writes its output through device memory. Bytes per token
and layer, bf16 activations (2 bytes) and fp32 intermediates (4), h hidden, g·d key/value width, f FFN
width; the backward as autograd runs each operator's derivative (reads the incoming gradient and what
the derivative needs, writes the input gradients; gradients of a tensor used twice are summed):

=========================================  =======================================  ===================
operator (PyTorch's decomposition)         forward                                  backward
=========================================  =======================================  ===================
RMSNorm ``(x.float() * rsqrt(mean(x²)))``  float 6h, pow 8h, mean 4h, mul 8h,       mul 12h, cast 6h,
``.type_as(x) * weight``, twice a layer    cast 6h, weight mul 4h → 36h             mul 24h, pow 16h,
                                                                                    sum 12h, cast 6h → 76h
rotary (complex product) on q and k        float 6w, complex mul 8w, cast 6w → 20w  the same 20w
``repeat_kv`` of k and v (g·d < h)         copy 2(2gd + 2h)                         sum 2(2gd + 2h)
attention output ``.contiguous()``         4h                                       4h
SwiGLU ``silu(w1 x) * w3 x``               silu 4f, mul 6f → 10f                    mul 12f, silu 6f → 18f
two residual adds                          2 × 6h                                   2 × 6h (summed grads)
=========================================  =======================================  ===================

Families other than Llama use ``nn.LayerNorm`` (one ``native_layer_norm`` kernel even in eager: 4h
forward, 6h backward), no rotary embedding, and a one-input activation (GeLU: 4f forward, 6f backward).

(w = h for q, g·d for k.) The cross-entropy on the fp32 logits (``cross_entropy(pred.float(), …)``):
cast 6, log-softmax 16 (max, sum of exponentials, output), forward 22 bytes per logit; backward:
the NLL gradient 4, log-softmax's 16, the cast 6 → 26. Its memory at the backward's peak: the
log-softmax output, its incoming gradient and the input gradient, 12 bytes per logit.

``compiled`` (``torch.compile`` of each transformer block, torchtitan's ``apply_compile``): the blocks'
elementwise chains fused as ``fused`` prices them; the loss stays eager (outside the compiled blocks).

Tensor parallelism splits the q/k/v, SwiGLU and attention-output widths by t, and with sequence
parallelism the norms and residual adds too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pipewright.cost.layer import kv_width
from pipewright.errors import ConfigError
from pipewright.ir import F, I, W
from pipewright.models.spec import ModelSpec

KERNELS = ("fused", "eager", "compiled")
#: bytes per logit the cross-entropy moves (F, I) and keeps at its peak, per kernel implementation
_LOSS = {
    "fused": ({F: 12.0, I: 10.0, W: 0.0}, 4.0),
    "eager": ({F: 22.0, I: 26.0, W: 0.0}, 12.0),
}


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ConfigError(f"--kernels must be one of {', '.join(KERNELS)} (got {kernels!r})")


def eager_layer_bytes(spec: ModelSpec, t: int = 1, sequence_parallel: bool = False) -> tuple[float, float]:
    """Bytes per token one layer's eager memory-bound operators move, forward and backward, per device
    (module docstring's table)."""
    h, f, kv = spec.hidden, spec.ffn_hidden, kv_width(spec)
    outside = h / (t if sequence_parallel else 1)  # norms and residual adds
    llama = spec.family == "llama"  # RMSNorm decomposed as above; else aten.native_layer_norm: 4h, 6h
    norms_f, norms_b = 2 * (36 if llama else 4) * outside, 2 * (76 if llama else 6) * outside
    residual = 2 * 6 * outside
    rotary = 20 * (h + kv) / t if llama else 0.0
    repeat = 2 * (2 * kv + 2 * h) / t if kv < h else 0.0
    contiguous = 4 * h / t
    gated = spec.mlp == "swiglu"
    mlp_f, mlp_b = ((10 if gated else 4) * f / t, (18 if gated else 6) * f / t)
    common = rotary + repeat + contiguous + residual
    return norms_f + mlp_f + common, norms_b + mlp_b + common


def loss_bytes(kernels: str) -> tuple[Mapping[str, float], float]:
    """(bytes per logit moved by F and I, bytes per logit kept) of the cross-entropy: the fused kernel,
    or PyTorch's eager one (also under ``compiled``, whose compiled regions are the blocks)."""
    check_kernels(kernels)
    moved, kept = _LOSS["fused" if kernels == "fused" else "eager"]
    return MappingProxyType(moved), kept


def layer_traffic(cost, esize: float) -> tuple[float, float]:
    """Bytes one layer's memory-bound kernels move per microbatch and device, forward and backward,
    before the context-parallel split, for a :class:`~pipewright.cost.transformer.TransformerCost`
    with ``esize``-byte activations: the eager count (module docstring) or κ × the stored bytes."""
    if cost.kernels == "eager":
        fwd, bwd = eager_layer_bytes(cost.spec, cost.mesh.tp, cost.sequence_parallel)
        scale = cost.spec.seq_len * cost.microbatch * esize / 2
        return fwd * scale, bwd * scale
    fwd = cost.efficiency.memory_traffic * cost.layer_stored_bytes("none", fp8=False)
    return fwd, 2 * fwd
