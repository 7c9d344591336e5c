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
  counted tensor by tensor from their autograd graphs, in units of s·b·h elements:

  GPT (models/gpt.py): LayerNorm inputs 2, QKV input 1, attention core q, k, v, output 4, projection
  input 1, MLP input 1, GELU input and output 2·f/h → 9 + 2f/h (17 for f = 4h); selective drops the
  core's output (q, k, v are its checkpoint inputs) → 8 + 2f/h; full keeps the layer input → 1.

  Llama (models/llama.py): each RMSNorm keeps its fp32 input, normalised value and output (3, two
  norms 6), attention core q, k and v repeated to a heads, output 4, o input 1, SwiGLU gate and up
  outputs, SiLU output and down input 4·f/h → 11 + 4f/h; selective drops the core's output → 10 + 4f/h;
  full → 1. (Under bf16 the RMSNorm's fp32 copy is twice the size: counted as 2 more elements.)

Pure Python.
"""

from __future__ import annotations

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
    microbatch without tensor parallelism (see the module docstring)."""
    _check(mode)
    if mode == "full":
        return 1.0
    ratio = spec.ffn_hidden / spec.hidden
    llama = spec.family == "llama"
    kept = 11 + 4 * ratio + (2 if low_precision else 0) if llama else 9 + 2 * ratio
    return kept - (1 if mode == "selective" else 0)


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
