"""GEMM time by shape: tile and wave quantisation over the GPU's streaming multiprocessors.

A GEMM of m × n × k (2·m·n·k FLOPs) runs as ⌈m/T_m⌉·⌈n/T_n⌉ output tiles of T_m × T_n, spread over
the device's S SMs in waves of S tiles. The last wave is partly idle, and so are the padded parts of
edge tiles:

    efficiency(m, n) = (m·n / (T_m·T_n·tiles)) · (tiles / (S·⌈tiles/S⌉))

The libraries choose the tile per shape (cuBLAS/CUTLASS heuristics): the model takes the best of
256×128, 128×256 and 128×128 tiles, and of 128×64 and 64×128 ones at 90 % of their rate (1 for shapes
that fill every wave; a small GEMM of a few tiles reaches a few percent of the peak).
The time is then 2·m·n·k / (peak × base × efficiency), ``base`` the fraction of the peak a large,
well-shaped GEMM reaches (:attr:`pipewright.hardware.Accelerator.gemm_efficiency`, or a measured
calibration, :mod:`pipewright.cost.calibration`).

NVIDIA, "Matrix Multiplication Background User's Guide" (tile and wave quantisation).
"""

from __future__ import annotations

import math

#: output tile shapes the GEMM libraries choose among, with the fraction of the large-tile rate each
#: reaches (smaller tiles reuse less data per FLOP)
TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 1.0), (128, 64, 0.9), (64, 128, 0.9))


def tile_efficiency(m: float, n: float, sms: int, tm: int, tn: int) -> float:
    """Padding × last-wave loss of an m × n output in tm × tn tiles over ``sms`` SMs."""
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    tiles = tiles_m * tiles_n
    padding = (m * n) / (tiles * tm * tn)
    return padding * tiles / (math.ceil(tiles / sms) * sms)


def wave_efficiency(m: float, n: float, sms: int) -> float:
    """The fraction of the SMs' time an m × n output keeps busy with the best of :data:`TILES`
    (module docstring); 1 with ``sms`` 0."""
    if sms <= 0:
        return 1.0
    return max(rate * tile_efficiency(m, n, sms, tm, tn) for tm, tn, rate in TILES)


def roofline(flops: float, rate: float, nbytes: float, bandwidth: float) -> float:
    """Seconds of a kernel of ``flops`` at ``rate`` FLOP/s that moves ``nbytes`` per FLOP through
    memory at ``bandwidth``: the slower of the two (memory-bound where FLOPs per byte are few)."""
    return max(flops / rate, flops * nbytes / bandwidth)


def batched_attention_bytes(spec, esize: float, cp: int = 1) -> float:
    """Bytes per FLOP of eager attention's batched GEMMs (Q·Kᵀ with k = d, scores·V with n = d, per head
    of size d over s/c tokens): Q·Kᵀ reads Q and K (2·s·d elements per head) and writes the s² scores,
    scores·V reads the scores and V and writes the output (s² + 2·s·d), for 4·s²·d FLOPs: esize ×
    (1/(2d) + 1/s) — a few tens of FLOPs per byte at d = 64, memory-bound on GPUs whose FLOP/s per
    byte/s is higher (A100: 153). The backward's gradient products move as much per FLOP."""
    d = spec.hidden / spec.heads
    return esize * (1 / (2 * d) + cp / spec.seq_len)


#: bytes of one GEMM operand element per dtype
_OPERAND_BYTES = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4}


def gemm_seconds(gemms, gpu, dtype: str, eff, calibration=None) -> float:
    """Seconds of ``gemms`` ((m, n, k, count) each) on accelerator ``gpu`` with efficiency ``eff``: a
    calibration's measured rate for the shape, else peak × gemm efficiency (× fp8 factor) × wave
    quantisation; with the shape model (``eff.waves``) no faster than its operands' bytes,
    esize·(mk + kn + mn), allow at the memory bandwidth (:func:`roofline`; skinny GEMMs are
    memory-bound). The cost model's and the planner's one formula."""
    peak = gpu.peak(dtype)
    base, sms = eff.gemm * (eff.fp8 if dtype == "fp8" else 1.0), gpu.sms if eff.waves else 0
    bandwidth = gpu.memory_bandwidth if calibration is None else calibration.memory_bandwidth
    esize = _OPERAND_BYTES.get(dtype, 2) if eff.waves else 0
    total = 0.0
    for m, n, k, count in gemms:
        rate = None if calibration is None else calibration.gemm_flops_per_second(m, n, k, dtype)
        if rate is None:
            rate = peak * base * wave_efficiency(m, n, sms)
        flops = 2 * m * n * k
        total += count * roofline(flops, rate, esize * (m * k + k * n + m * n) / flops, bandwidth)
    return total
