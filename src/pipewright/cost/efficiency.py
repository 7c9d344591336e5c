"""How close to the hardware's peaks the kernels run: the calibrated constants of the analytical cost
model (:class:`Efficiency`), the A100 calibration and each accelerator's defaults."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipewright.cost.attention_kernels import kernel_efficiency
from pipewright.hardware import Accelerator


@dataclass(frozen=True)
class Efficiency:
    """How close to the hardware's peaks the kernels run — the explicit, calibrated part of the model.

    - ``gemm``: fraction of peak FLOP/s a large, well-shaped matrix multiplication reaches (each GEMM
      further scaled by its tile/wave quantisation, :mod:`pipewright.cost.gemm`).
    - ``memory_traffic`` κ: bytes the memory-bound kernels of a layer move through device memory in
      the forward, per byte of activation a forward without recomputation stores; the backward moves
      twice that, a recomputed forward once more; the time is bytes / memory bandwidth.
    - ``comm``: fraction of link bandwidth that collectives and point-to-point transfers reach (NCCL's
      bus bandwidth over the link's peak).
    - ``attention``: fraction of peak the attention core reaches (None: ``gemm``).
    - ``waves``: the shape model — each GEMM scaled by its tile/wave quantisation on the device's SMs,
      and eager attention's batched GEMMs no faster than the bytes they move allow (memory-bound,
      :mod:`pipewright.cost.gemm`); off, every GEMM runs at ``gemm`` × peak. The calibrated
      defaults (:data:`A100_EFFICIENCY`, :func:`default_efficiency`) turn it on.
    - ``layer_overhead`` τ: seconds per layer and forward that do not scale with the work (kernel
      launches, host-side scheduling of the ~30 kernels of a layer); the backward adds 2τ (1.5τ in I,
      0.5τ in W). It is why small models fall short of the GEMM rate on fast GPUs.
    - ``fp8``: FP8 GEMMs reach ``gemm`` × ``fp8`` of the FP8 peak (scaling and casting the inputs,
      Transformer Engine's amax bookkeeping).
    - ``dispatch``/``host_per_kernel`` δ: the framework's dispatch model (:mod:`pipewright.cost.dispatch`)
      and the host seconds per kernel launch; a pass takes at least its kernels × δ (0: not priced).
    - ``optimizer_bytes``: bytes per parameter the optimizer step moves through device memory (a
      ``STEP`` per stage after its gradient reduction, at the memory bandwidth; 0: not priced).

    The defaults are calibrated for A100 (fp16, Selene) on Megatron-LM Table 1 (``tools/table1.py``;
    docs/simulator.md, "Fidelity: Megatron-LM Table 1").
    """

    gemm: float = 0.68
    memory_traffic: float = 2.25
    comm: float = 0.8
    attention: float | None = None
    waves: bool = False
    layer_overhead: float = 0.0
    fp8: float = 1.0
    dispatch: str = "fused"
    host_per_kernel: float = 0.0
    optimizer_bytes: float = 0.0

    @property
    def attention_rate(self) -> float:
        return self.gemm if self.attention is None else self.attention


#: The calibrated A100 parameters (the dataclass defaults, with wave quantisation).
A100_EFFICIENCY = Efficiency(waves=True)


def default_efficiency(acc: Accelerator) -> Efficiency:
    """The calibration defaults of ``acc``: its large-GEMM efficiency, layer overhead and FP8 GEMM
    factor with wave quantisation, the A100's κ and comm, and the attention rate of its generation's
    usual kernel (:mod:`pipewright.cost.attention_kernels`; None where it has no figure)."""
    return replace(
        A100_EFFICIENCY,
        gemm=acc.gemm_efficiency,
        layer_overhead=acc.layer_overhead,
        fp8=acc.fp8_efficiency,
        attention=acc.attention_efficiency or kernel_efficiency(acc.name, None),
        waves=True,
    )
