"""How the memory-bound kernels run (``--kernels fused|eager|compiled``): bytes they move.

``fused`` (the default; Megatron-Core with Transformer Engine and Apex kernels): a layer's norms,
activations, rotary embedding, dropout and residual adds move κ (:attr:`Efficiency.memory_traffic`)
× the bytes a forward stores, the backward twice that, and the vocabulary-parallel cross-entropy is
one fused kernel (12 bytes per logit forward, 10 backward) that keeps one fp32 copy of the logits
(4 bytes per logit) — :mod:`pipewright.cost.transformer`.

``eager`` (PyTorch eager, as torchtitan's Llama runs it: ``models/norms.py`` RMSNorm,
``models/llama/model.py`` rotary embedding, ``repeat_kv``, SwiGLU and residual adds): every operator
is its own kernel that reads its inputs and writes its output through device memory. Bytes per
element (bf16 activations, fp32 intermediates), forward and backward as autograd runs them — the sum,
over the ATen operators PyTorch dispatches, of each one's tensor inputs and outputs (broadcast
operands once), counted with a ``TorchDispatchMode`` (``tests/test_cost_modern.py`` recounts them):

==============================================  ===========  ========  ==========  ===============
operator                                        per element  forward   backward    ATen operators
==============================================  ===========  ========  ==========  ===============
RMSNorm ``(x.float() * rsqrt(mean(x²) + ε))``   h, twice     36        92          6 fwd, 13 bwd
``.type_as(x) * weight``
rotary embedding (complex product), q and k     h + g·d      20        20          3, 3
``repeat_kv`` of k and v (g·d < h)              h, twice     2 + 2gd/h same        1, 1
attention output ``.contiguous()``              h            4         4           1, 1
SwiGLU ``silu(w1 x) * w3 x``                    f            10        18          2, 3
residual add (backward: the fan-out's sum)      h, twice     6         6           1, 1
cross-entropy on ``pred.float()``               logit        18        26          3, 3
==============================================  ===========  ========  ==========  ===============

The cross-entropy keeps, at the backward's peak, the log-softmax output, its incoming gradient and
the input gradient: 12 bytes per logit. With tensor parallelism torchtitan runs it under
``loss_parallel()`` (``ParallelDims.loss_parallel_enabled``: tp > 1 unless disabled), on
vocabulary-sharded logits, whose backward PyTorch writes as ``(grad_input + torch.exp(x)) *
grad_output`` with ``grad_input = torch.zeros_like(x)`` (torch/distributed/tensor/parallel/loss.py,
``_nll_loss_and_log_softmax_backward``): the log-softmax output x, the zeros, ``exp(x)`` and their sum
are live together, 16 bytes per logit (the forward's peak, ``_log_softmax``'s x, ``x − max`` and
``exp`` beside the 16-bit logits, is 14). Families other than Llama use ``nn.LayerNorm`` (one
``native_layer_norm`` kernel even in eager: 4 forward, 6 backward per h), no rotary embedding, and a
one-input activation (GeLU: 4 forward, 6 backward per f).

``compiled`` (``torch.compile`` of each transformer block, torchtitan's ``apply_compile``): the blocks'
elementwise chains fused as ``fused`` prices them; the loss stays eager (outside the compiled blocks).

Tensor parallelism splits the q/k/v, SwiGLU and attention-output widths by t, and with sequence
parallelism the norms and residual adds too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pipewright.cost.cost_inputs import CostInputs
from pipewright.cost.layer import kv_width
from pipewright.errors import ConfigError
from pipewright.ir import F, I, W
from pipewright.models.spec import ModelSpec

KERNELS = ("fused", "eager", "compiled")
#: eager bytes per element, (forward, backward), of the module docstring's operators
EAGER_BYTES = {
    "rmsnorm": (36.0, 92.0),
    "layernorm": (4.0, 6.0),
    "rotary": (20.0, 20.0),
    "contiguous": (4.0, 4.0),
    "swiglu": (10.0, 18.0),
    "gelu": (4.0, 6.0),
    "residual": (6.0, 6.0),
    "cross_entropy": (18.0, 26.0),
}
#: bytes per logit the cross-entropy moves (F, I) and keeps at its peak, per kernel implementation
_LOSS = {
    "fused": ({F: 12.0, I: 10.0, W: 0.0}, 4.0),
    "eager": ({F: EAGER_BYTES["cross_entropy"][0], I: EAGER_BYTES["cross_entropy"][1], W: 0.0}, 12.0),
}


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ConfigError(f"--kernels must be one of {', '.join(KERNELS)} (got {kernels!r})")


def eager_layer_bytes(spec: ModelSpec, t: int = 1, sequence_parallel: bool = False) -> tuple[float, float]:
    """Bytes per token one layer's eager memory-bound operators move, forward and backward, per device
    (module docstring's table; tensor parallelism splits q/k/v, the MLP and the attention output by t,
    sequence parallelism the norms and residual adds too)."""
    h, f, kv = spec.hidden, spec.ffn_hidden, kv_width(spec)
    outside = h / (t if sequence_parallel else 1)  # norms and residual adds
    llama = spec.family == "llama"
    widths = {
        "rmsnorm" if llama else "layernorm": 2 * outside,
        "residual": 2 * outside,
        "rotary": (h + kv) / t if llama else 0.0,
        "contiguous": h / t,
        "swiglu" if spec.mlp == "swiglu" else "gelu": f / t,
    }
    fwd = sum(EAGER_BYTES[op][0] * n for op, n in widths.items())
    bwd = sum(EAGER_BYTES[op][1] * n for op, n in widths.items())
    repeat = 2 * (2 * kv + 2 * h) / t if kv < h else 0.0  # read g·d, write h (bf16), k and v
    return fwd + repeat, bwd + repeat


#: bytes per logit PyTorch's loss-parallel cross-entropy keeps at its backward's peak (docstring)
LOSS_PARALLEL_KEPT = 16.0


def loss_bytes(kernels: str, loss_parallel: bool = False) -> tuple[Mapping[str, float], float]:
    """(bytes per logit moved by F and I, bytes per logit kept) of the cross-entropy: the fused kernel,
    or PyTorch's eager one (also under ``compiled``, whose compiled regions are the blocks);
    ``loss_parallel``: the eager one on vocabulary-sharded logits (module docstring)."""
    check_kernels(kernels)
    moved, kept = _LOSS["fused" if kernels == "fused" else "eager"]
    if loss_parallel and kernels != "fused":
        kept = LOSS_PARALLEL_KEPT
    return MappingProxyType(moved), kept


#: Megatron's GPT layer (Megatron-DeepSpeed, Megatron-LM before Transformer Engine), bytes per element of
#: each memory-bound kernel as its code runs it, 16-bit activations, (forward, backward), and the width
#: it runs on: Apex's fused layer norm (read x, write y; backward read dy and x, write dx), the jit-fused
#: bias-dropout-add (read x, bias and residual, write y and the 1-byte mask; backward read dy and the
#: mask, write dx and the bias gradient's pass), the jit-fused bias-GeLU (read, write; backward read dy
#: and x, write dx), the context's ``permute().contiguous()``, the residual fan-out's gradient sum, and
#: per attention score the fused scale-mask-softmax (read, write; backward read dy and y, write dx) with
#: the attention dropout (read, write, 1-byte mask; backward read dy and mask, write dx)
MEGATRON_BYTES = {
    "layernorm": (4.0, 6.0),
    "bias_dropout_add": (7.0, 7.0),
    "bias_gelu": (4.0, 6.0),
    "contiguous": (4.0, 4.0),
    "residual_grad": (0.0, 6.0),
    "softmax": (4.0, 6.0),
    "attention_dropout": (5.0, 5.0),
}
#: Megatron's unfused fp32 softmax path where its fused kernel cannot run (pipewright.cost.dispatch.
#: fused_softmax_runs): cast up, scale, mask, softmax, cast down, each a pass over the scores, and the
#: backward of each
MEGATRON_SOFTMAX_FALLBACK = (34.0, 42.0)


def megatron_layer_bytes(spec: ModelSpec, t: int, softmax_fused: bool = True) -> tuple[float, float]:
    """Bytes per token one Megatron GPT layer's memory-bound kernels move, forward and backward, per
    tensor-parallel rank without sequence parallelism (:data:`MEGATRON_BYTES`: the two norms, two
    bias-dropout-adds and two residual gradient sums on the full hidden h on every rank; the bias-GeLU
    on f/t, the context copy on h/t; the softmax and attention dropout on the a/t · s scores a token
    has in eager attention, or :data:`MEGATRON_SOFTMAX_FALLBACK` for the softmax where its fused
    kernel does not run)."""
    h, f, s = spec.hidden, spec.ffn_hidden, spec.seq_len
    scores = spec.heads / t * s
    softmax = MEGATRON_BYTES["softmax"] if softmax_fused else MEGATRON_SOFTMAX_FALLBACK
    widths = (
        (MEGATRON_BYTES["layernorm"], 2 * h),
        (MEGATRON_BYTES["bias_dropout_add"], 2 * h),
        (MEGATRON_BYTES["residual_grad"], 2 * h),
        (MEGATRON_BYTES["bias_gelu"], f / t),
        (MEGATRON_BYTES["contiguous"], h / t),
        (softmax, scores),
        (MEGATRON_BYTES["attention_dropout"], scores),
    )
    return sum(b[0] * n for b, n in widths), sum(b[1] * n for b, n in widths)


def cost_loss_bytes(cost: CostInputs) -> Mapping[str, float]:
    """Bytes per logit the cross-entropy of a cost model (its :class:`CostInputs`) moves in F and I:
    its framework's own loss where the dispatch model states one under the default ``fused`` kernels
    (Megatron's ``vocab_parallel_cross_entropy`` on ``output.float()``:
    :attr:`pipewright.cost.dispatch.Dispatch.loss_bytes`), else :func:`loss_bytes`."""
    from pipewright.cost.dispatch import dispatch

    own = dispatch(cost.efficiency.dispatch).loss_bytes
    if own is not None and cost.kernels == "fused":
        return MappingProxyType({F: own[0], I: own[1], W: 0.0})
    return loss_bytes(cost.kernels)[0]


def layer_traffic(cost: CostInputs, esize: float, stored: float) -> tuple[float, float]:
    """Bytes one layer's memory-bound kernels move per microbatch and device, forward and backward,
    before the context-parallel split, for a cost model (its :class:`CostInputs`) with ``esize``-byte
    activations: the eager count (module docstring) or κ × ``stored``, the bytes the cost model's
    layer stores without recomputation and without FP8 copies."""
    if cost.kernels == "eager":
        fwd, bwd = eager_layer_bytes(cost.spec, cost.mesh.tp, cost.sequence_parallel)
        scale = cost.spec.seq_len * cost.microbatch * esize / 2
        return fwd * scale, bwd * scale
    from pipewright.cost.dispatch import cost_softmax_fused, dispatch

    if dispatch(cost.efficiency.dispatch).counted_bytes and cost.attention == "eager":
        fwd, bwd = megatron_layer_bytes(cost.spec, cost.mesh.tp, cost_softmax_fused(cost))
        scale = cost.spec.seq_len * cost.microbatch * esize / 2
        return fwd * scale, bwd * scale
    fwd = cost.efficiency.memory_traffic * stored
    return fwd, 2 * fwd
