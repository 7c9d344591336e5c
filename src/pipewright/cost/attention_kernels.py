"""Fused attention kernels and the fraction of the 16-bit dense peak each reaches, per GPU generation.

The attention core of a layer (Q·Kᵀ, softmax, P·V and their backward) runs in one fused kernel whose
speed depends on the kernel, not on the GEMM efficiency of the linear layers. Each figure below is a
published kernel benchmark at head dimension 128, causal, bf16, long sequences — never fitted to the
training runs of docs/fidelity.md:

- ``fa2`` (FlashAttention-2, Dao 2023; PyTorch SDPA's flash backend): A100 0.62 — forward + backward
  about 190–200 TFLOP/s of 312 at head dimension 128 with the causal mask (Dao 2023, Fig. 4–5; the
  abstract's "50–73 % of the theoretical maximum" for the forward); Hopper 0.35 — "FlashAttention-2
  achieving only 35 % utilization on H100" (Shah et al. 2024, abstract), and 329 TFLOP/s of 989
  measured for PyTorch SDPA's default backend at (1, 24, 4608, 128) on an H100 with the nightly of
  2024-12-04 (pytorch/pytorch#142132).
- ``fa3`` (FlashAttention-3, Shah et al. 2024; Hopper only): 0.66 — about 650 TFLOP/s forward with the
  causal mask at head dimension 128 and 16k tokens (Shah et al. 2024, Fig. 5; up to 740 = 75 %
  without the mask).
- ``cudnn`` (cuDNN fused attention, Transformer Engine's default backend on Hopper): 0.64 — 631
  TFLOP/s of 989 at (1, 24, 4608, 128) on an H100 with cuDNN 9.1 (pytorch/pytorch#142132, the same
  measurement that gives FlashAttention-3 632).

``DEFAULT_KERNEL`` names each generation's usual kernel: FlashAttention-2 on Ampere (Megatron-LM and
NeMo through Transformer Engine, PyTorch SDPA), cuDNN on Hopper (Transformer Engine's). Blackwell has
no figure here: its attention is priced at the GEMM efficiency and naming a kernel for it is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pipewright.errors import ConfigError

#: generation → kernel → fraction of the 16-bit dense peak (module docstring for the sources)
KERNELS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "ampere": MappingProxyType({"fa2": 0.62}),
        "hopper": MappingProxyType({"fa2": 0.35, "fa3": 0.66, "cudnn": 0.64}),
    }
)
#: each generation's usual kernel
DEFAULT_KERNEL: Mapping[str, str] = MappingProxyType({"ampere": "fa2", "hopper": "cudnn"})
#: every kernel name any generation knows
KERNEL_NAMES = ("fa2", "fa3", "cudnn")

_GENERATION_PREFIXES = (
    ("a100", "ampere"),
    ("a800", "ampere"),
    ("h100", "hopper"),
    ("h200", "hopper"),
    ("h800", "hopper"),
    ("gh200", "hopper"),
)


def generation(gpu: str) -> str | None:
    """The GPU generation of accelerator preset ``gpu`` (None for one without kernel figures)."""
    for prefix, gen in _GENERATION_PREFIXES:
        if gpu.startswith(prefix):
            return gen
    return None


def default_kernel(gpu: str) -> str | None:
    """The usual attention kernel on ``gpu`` (None where no kernel figure is known)."""
    gen = generation(gpu)
    return None if gen is None else DEFAULT_KERNEL.get(gen)


def kernel_efficiency(gpu: str, kernel: str | None) -> float | None:
    """Fraction of ``gpu``'s 16-bit peak attention ``kernel`` reaches (None: ``gpu``'s default kernel;
    None back where the GPU has no figure, i.e. the GEMM efficiency). One-line error for an unknown
    kernel or one without a published figure on this generation."""
    if kernel is not None and kernel not in KERNEL_NAMES:
        raise ConfigError(f"--attention-kernel must be one of {', '.join(KERNEL_NAMES)} (got {kernel!r})")
    gen = generation(gpu)
    known = KERNELS.get(gen or "", {})
    name = kernel or default_kernel(gpu)
    if name is None:
        return None
    if name not in known:
        choices = ", ".join(known) or "none"
        raise ConfigError(f"no published {name} attention figure for {gpu} (kernels with one: {choices})")
    return known[name]
