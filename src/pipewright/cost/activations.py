"""Activation memory per transformer layer and microbatch under none / selective / full recomputation.

Two accountings (bytes; s = sequence, b = microbatch, h = hidden, a = heads, f = FFN size, t = tensor
parallel size, e = bytes per activation element):

- :func:`korthikanti_layer_bytes` — Korthikanti et al. 2022 (Table 2), what the analytical cost
  model uses for GPT: 16-bit activations with dropout masks, attention scores stored:
  none s·b·h·(10 + 24/t + 5·a·s/(h·t)), selective s·b·h·(10 + 24/t) (the 5·a·s²·b/t of the attention
  core dropped), full 2·s·b·h (the layer input); sequence parallelism divides the first term by t too.
  Scaled by e/2 for other element sizes.
- :func:`runtime_layer_elements` — what pipewright's own models keep (no dropout; PyTorch's fused
  attention kernels keep q, k, v, the output and a per-row log-sum-exp instead of the a·s² scores),
  counted tensor by tensor from their autograd graphs (``tests/test_measure_layer.py`` counts them),
  in units of s·b·h elements, g = kv heads (a for GPT):

  the layer input and the residual stream after attention (the norms' 16-bit inputs; RMSNorm
  recomputes its fp32 part) 2, the two norms' outputs (the QKV and MLP inputs) 2, q 1, k and v 2g/a,
  the attention output (also the projection's input) 1 → 6 + 2g/a; GPT's MLP: GELU input and output
  2·f/h; Llama's SwiGLU: gate, up and their product (the down projection's input; silu recomputed in
  the backward) 3·f/h. Llama 3 8B: 6 + 0.5 + 10.5 = 17, Megatron's 34 bytes a token and hidden unit.
  Selective recomputation drops only the core's row log-sum-exp (q, k, v are its checkpoint inputs,
  the output is the projection's input): the same; full keeps the layer input → 1.

Pure Python.
"""

from __future__ import annotations

from pipewright.cost.layer_activations import implementation_layer_bytes
from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")


def _check(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)} (got {mode!r})")


def korthikanti_layer_bytes(
    spec: ModelSpec, b: int, mode: str, *, element_bytes: int = 2, t: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes one layer keeps per microbatch (Korthikanti et al. 2022; see the module docstring)."""
    _check(mode)
    s, h, a = spec.seq_len, spec.hidden, spec.heads
    sbh = s * b * h
    if mode == "full":
        stored = 2 * sbh / (t if sequence_parallel else 1)
    else:
        linear = 34 / t if sequence_parallel else 10 + 24 / t
        scores = 5 * a * s / (h * t) if mode == "none" else 0.0
        stored = sbh * (linear + scores)
    return stored * element_bytes / 2


def runtime_layer_elements(spec: ModelSpec, mode: str, *, low_precision: bool = False) -> float:
    """Elements, in units of s·b·h, one layer of pipewright's ``spec.family`` model keeps per
    microbatch without tensor parallelism (see the module docstring): 6 + 2g/a + (3 for Llama, 2 for
    GPT)·f/h; 1 with full recomputation. ``low_precision`` does not change the count (the norms keep
    their 16-bit input). A spec whose layers are another implementation's
    (:mod:`pipewright.cost.layer_activations`: a Hugging Face family's modules) counts that set's bytes
    over the element size (2 bytes with ``low_precision``, else 4)."""
    _check(mode)
    if mode == "full":
        return 1.0
    e = 2 if low_precision else 4
    implemented = implementation_layer_bytes(spec, 1, e, 1, mode)
    if implemented is not None:
        return implemented / (spec.seq_len * spec.hidden * e)
    kv = (spec.kv_heads or spec.heads) / spec.heads
    return 6 + 2 * kv + (3 if spec.family == "llama" else 2) * spec.ffn_hidden / spec.hidden


def runtime_stage_peak_bytes(
    spec: ModelSpec,
    b: int,
    mode: str,
    *,
    layers: int,
    in_flight: int,
    element_bytes: int = 4,
    first: bool = False,
    last: bool = False,
) -> float:
    """Predicted peak activation bytes of one stage: ``in_flight`` microbatches' kept activations —
    ``layers`` layers each; on a stage that sends its output, that output (s·b·h, kept until its
    gradient returns); on the last stage the final norm's and output layer's inputs (2·s·b·h) and the
    loss's fp32 log-softmax (4·s·b·V bytes) — plus, with full recomputation, one layer's activations
    rebuilt during the backward. (``first`` is accepted for symmetry: the embedding's output is the
    first layer's input, already counted.)"""
    del first
    sbh = spec.seq_len * b * spec.hidden
    per_mb = (
        layers * runtime_layer_elements(spec, mode, low_precision=element_bytes < 4) * sbh * element_bytes
    )
    if last:
        per_mb += 2 * sbh * element_bytes + spec.seq_len * b * spec.vocab * 4
    else:
        per_mb += sbh * element_bytes
    transient = runtime_layer_elements(spec, "none") * sbh * element_bytes if mode == "full" else 0.0
    return in_flight * per_mb + transient
