"""Catalogue of accelerators and links: vendor datasheet numbers, dense (no structured sparsity).

Units: FLOP/s, bytes, bytes/s (1 GB/s = 1e9 bytes/s) and seconds. A link's ``bandwidth`` is per direction
and, for NVLink and PCIe, what one GPU gets over all its lanes/links (NVLink 3 on an A100: 12 links ×
25 GB/s = 300 GB/s each way, NVIDIA's "600 GB/s" counting both directions). Latencies are end-to-end
estimates of one small message through the usual software stack (NCCL/gloo), not wire latencies.

Lookups take lowercase names (``accelerator("a100-80gb")``, ``link("ib-hdr")``); a typo raises a one-line
:class:`~pipewright.errors.PipewrightError` listing the known names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipewright.errors import PipewrightError

GB = 1e9
#: device memory is given as the driver reports it (``nvidia-smi``, MiB), not as the datasheet's
#: decimal "80 GB": an H100 80GB has 81,559 MiB = 79.6 GiB, not 80e9 bytes = 74.5 GiB
MIB = 2**20
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    """One device kind. ``peak_flops`` maps dtype ("fp32", "tf32", "fp16", "bf16", "fp8") to dense peak
    FLOP/s; dtypes the device has no fast path for are absent. ``nvlink``: the name of the device's
    NVLink generation in :func:`link` (``None`` without NVLink). ``fabric``: the link kind of the usual
    cluster's inter-node network, one NIC per GPU (DGX A100: 8 × HDR; DGX H100/H200/B200: 8 × NDR,
    rail-optimised). ``sms``: streaming multiprocessors (the wave size of the GEMM efficiency model,
    :mod:`pipewright.cost.gemm`; 0 = no wave quantisation). ``gemm_efficiency``: the fraction of the
    dense peak a large, well-shaped GEMM reaches there, ``layer_overhead`` the seconds per layer and
    forward that do not scale with the work, ``fp8_efficiency`` the fraction of that GEMM efficiency
    FP8 GEMMs keep, ``attention_efficiency`` the fraction of the 16-bit peak the fused attention
    kernels reach (None: the GEMMs') — the cost model's default calibration
    (:func:`pipewright.cost.efficiency.default_efficiency`). ``collective_step_latency``: the least
    seconds per ring step a launched NCCL collective takes among these GPUs (a small all-reduce over n
    GPUs takes at least 2(n − 1) of them; 0: no measured figure), :mod:`pipewright.cost.comm`."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    nvlink: str | None = None
    source: str = ""
    fabric: str = "ib-hdr"
    sms: int = 0
    gemm_efficiency: float = 0.68
    layer_overhead: float = 0.0
    fp8_efficiency: float = 1.0
    attention_efficiency: float | None = None
    collective_step_latency: float = 0.0

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; one-line error naming the dtypes this device has."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            known = ", ".join(self.peak_flops)
            raise PipewrightError(f"{self.name} has no {dtype} peak; choose one of: {known}") from None


@dataclass(frozen=True)
class Link:
    """One kind of connection: per-direction ``bandwidth`` (bytes/s) and one-message ``latency`` (s)."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""


def _frozen(d: dict[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(d))


_V100 = Accelerator(
    "v100",
    _frozen({"fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS}),
    32 * GB,
    900 * GB,
    nvlink="nvlink2",
    sms=80,
    source="NVIDIA Tesla V100 datasheet (SXM2 32GB): 15.7 TFLOPS fp32, 125 TFLOPS tensor fp16, 900 GB/s",
)
_A100 = {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "fp16": 312 * TFLOPS, "bf16": 312 * TFLOPS}
_A100_40 = Accelerator(
    "a100-40gb",
    _frozen(_A100),
    40960 * MIB,
    1555 * GB,
    nvlink="nvlink3",
    sms=108,
    collective_step_latency=93e-6 / 14,
    source="NVIDIA A100 datasheet (SXM4 40GB): 19.5 fp32, 156 tf32, 312 fp16/bf16 TFLOPS dense, 1555 GB/s"
    " (memory 40,960 MiB as nvidia-smi reports an A100-SXM4-40GB); collective step latency: the "
    "a100-80gb's (vTrain's 93-96 us for 1-4 MiB all-reduces over 8 A100 SXM, 14 ring steps), carried "
    "over: the same GA100 chip and third-generation NVLink through NVSwitch, the memory size aside",
)
_A100_80 = Accelerator(
    "a100-80gb",
    _frozen(_A100),
    81920 * MIB,
    2039 * GB,
    nvlink="nvlink3",
    sms=108,
    collective_step_latency=93e-6 / 14,
    source="NVIDIA A100 datasheet (SXM4 80GB): 19.5 fp32, 156 tf32, 312 fp16/bf16 TFLOPS dense, 2039 GB/s"
    " (memory 81,920 MiB as nvidia-smi reports an A100-SXM4-80GB); collective step latency: vTrain "
    "(Bang et al., MICRO'24) measures 93-96 us for 1-4 MiB all-reduces over 8 A100 SXM (14 ring steps)",
)
_H100 = {
    "fp32": 67 * TFLOPS,
    "tf32": 494.5 * TFLOPS,
    "fp16": 989.5 * TFLOPS,
    "bf16": 989.5 * TFLOPS,
    "fp8": 1979 * TFLOPS,
}
#: Hopper/Blackwell calibration defaults (fitted on the rows docs/fidelity.md marks): large-GEMM
#: efficiency, seconds per layer and forward, FP8 GEMM factor
_HOPPER = {"gemm_efficiency": 0.66, "layer_overhead": 2.5e-4, "fp8_efficiency": 0.75}
_H100_SXM = Accelerator(
    "h100-sxm",
    _frozen(_H100),
    81559 * MIB,
    3350 * GB,
    nvlink="nvlink4",
    fabric="ib-ndr",
    sms=132,
    **_HOPPER,
    source="NVIDIA H100 datasheet (SXM5): 67 fp32, 494.5 tf32, 989.5 fp16/bf16, 1979 fp8 TFLOPS dense "
    "(half the sparsity figures), 80 GB HBM3, 3.35 TB/s"
    " (memory 81,559 MiB as nvidia-smi reports an H100 80GB HBM3)",
)
_H200 = Accelerator(
    "h200",
    _frozen(_H100),
    143771 * MIB,
    4800 * GB,
    nvlink="nvlink4",
    fabric="ib-ndr",
    sms=132,
    **_HOPPER,
    source="NVIDIA H200 datasheet (SXM): H100 SXM compute, 141 GB HBM3e, 4.8 TB/s"
    " (memory 143,771 MiB as nvidia-smi reports an H200)",
)
_H100_96 = Accelerator(
    "h100-hbm2e-96gb-500w",
    _frozen(_H100),
    97871 * MIB,
    2400 * GB,
    nvlink="nvlink4",
    fabric="ib-ndr",
    sms=132,
    **_HOPPER,
    source="Meta Grand Teton H100 (torchtitan's benchmarks): H100 SXM compute at a 500 W power limit, "
    "96 GB HBM2e, 2.4 TB/s; 400 Gb/s RoCE per GPU"
    " (memory 97,871 MiB as nvidia-smi reports the 96 GB H100 parts, GH200 and H20)",
)
_A800 = Accelerator(
    "a800",
    _frozen(_A100),
    81920 * MIB,
    2039 * GB,
    nvlink="nvlink3-a800",
    sms=108,
    source="NVIDIA A800 SXM4 80GB: A100 80GB compute and memory, NVLink cut to 400 GB/s (both directions)"
    " (memory 81,920 MiB, the A100 80GB's)",
)
_H100_PCIE = Accelerator(
    "h100-pcie",
    _frozen(
        {
            "fp32": 51 * TFLOPS,
            "tf32": 378 * TFLOPS,
            "fp16": 756 * TFLOPS,
            "bf16": 756 * TFLOPS,
            "fp8": 1513 * TFLOPS,
        }
    ),
    81559 * MIB,
    2000 * GB,
    nvlink=None,
    fabric="ib-ndr",
    sms=114,
    **_HOPPER,
    source="NVIDIA H100 datasheet (PCIe): 51 fp32, 378 tf32, 756 fp16/bf16, 1513 fp8 TFLOPS dense, "
    "80 GB HBM2e, 2.0 TB/s; PCIe 5.0 to the host"
    " (memory 81,559 MiB as nvidia-smi reports an H100 PCIe 80GB)",
)
_H800 = Accelerator(
    "h800",
    _frozen(_H100),
    81559 * MIB,
    3350 * GB,
    nvlink="nvlink4-h800",
    fabric="ib-ndr",
    sms=132,
    **_HOPPER,
    source="NVIDIA H800 SXM5: H100 SXM compute and memory, NVLink cut to 400 GB/s (both directions)"
    " (memory 81,559 MiB as nvidia-smi reports an H800)",
)
_B200 = Accelerator(
    "b200",
    _frozen(
        {
            "fp32": 75 * TFLOPS,
            "tf32": 1100 * TFLOPS,
            "fp16": 2250 * TFLOPS,
            "bf16": 2250 * TFLOPS,
            "fp8": 4500 * TFLOPS,
        }
    ),
    183359 * MIB,
    8000 * GB,
    nvlink="nvlink5-sxm",
    fabric="ib-ndr",
    sms=148,
    **_HOPPER,
    source="NVIDIA HGX B200 datasheet (per GPU): 2.25 PFLOPS fp16/bf16, 4.5 PFLOPS fp8 dense, 180 GB "
    "HBM3e, 8 TB/s, NVLink 5 1.8 TB/s (both directions); DGX B200: 8 × 400 Gb/s ConnectX-7"
    " (memory 183,359 MiB as nvidia-smi reports a B200)",
)

#: Measured on the development machine: a 1-thread fp32 matmul reaches about 90 GFLOP/s per core.
CPU_FLOPS_PER_CORE = 90e9


def _cpu() -> Accelerator:
    """One CPU "device" = one single-threaded process of the gloo runtime (``torch.set_num_threads(1)``):
    ≈ 90 GFLOP/s fp32 (measured) and the machine's physical memory, shared with the other processes."""
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        memory = 16 * GB
    return Accelerator(
        "cpu",
        _frozen({"fp32": CPU_FLOPS_PER_CORE}),
        memory,
        20 * GB,
        source="measured on this machine: 90 GFLOP/s fp32 per core; memory from sysconf; "
        "bandwidth an estimate (one core's share of DDR4)",
    )


_ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType(
    {
        a.name: a
        for a in (_V100, _A100_40, _A100_80, _A800, _H100_SXM, _H100_96, _H100_PCIE, _H800, _H200, _B200)
    }
)

_LINKS: Mapping[str, Link] = MappingProxyType(
    {
        x.name: x
        for x in (
            Link("nvlink2", 150 * GB, 3e-6, "V100 SXM2: 6 NVLink 2 links × 25 GB/s per direction"),
            Link("nvlink3", 300 * GB, 3e-6, "A100 SXM4: 12 NVLink 3 links × 25 GB/s per direction"),
            Link("nvlink4", 450 * GB, 3e-6, "H100/H200 SXM: 18 NVLink 4 links × 25 GB/s per direction"),
            Link("nvlink3-a800", 200 * GB, 3e-6, "A800 SXM: NVLink cut to 400 GB/s, 200 GB/s per direction"),
            Link("nvlink4-h800", 200 * GB, 3e-6, "H800 SXM: NVLink cut to 400 GB/s, 200 GB/s per direction"),
            Link("nvlink5-sxm", 900 * GB, 3e-6, "B200 SXM: 18 NVLink 5 links × 50 GB/s per direction"),
            Link("pcie3", 15.75 * GB, 5e-6, "PCIe 3.0 x16: 8 GT/s × 16 lanes, 128b/130b"),
            Link("pcie4", 31.5 * GB, 5e-6, "PCIe 4.0 x16: 16 GT/s × 16 lanes, 128b/130b"),
            Link("pcie5", 63 * GB, 5e-6, "PCIe 5.0 x16: 32 GT/s × 16 lanes, 128b/130b"),
            Link("ib-hdr", 25 * GB, 5e-6, "InfiniBand HDR: 200 Gb/s per port (NVIDIA ConnectX-6)"),
            Link("ib-ndr", 50 * GB, 5e-6, "InfiniBand NDR: 400 Gb/s per port (NVIDIA ConnectX-7)"),
            Link("eth-100g", 12.5 * GB, 10e-6, "100 Gb/s Ethernet (RoCE)"),
            Link("eth-25g", 3.125 * GB, 15e-6, "25 Gb/s Ethernet"),
            Link("gloo-loopback", 1.8 * GB, 2e-4, "measured: gloo over loopback TCP on this machine"),
        )
    }
)

_LINK_ALIASES: Mapping[str, str] = MappingProxyType(
    {"hdr": "ib-hdr", "ndr": "ib-ndr", "ethernet-100g": "eth-100g", "ethernet-25g": "eth-25g"}
)


def accelerator_names() -> tuple[str, ...]:
    return (*_ACCELERATORS, "cpu")


def link_names() -> tuple[str, ...]:
    return tuple(_LINKS)


def accelerator(name: str) -> Accelerator:
    """The accelerator called ``name`` (lowercase: v100, a100-40gb, a100-80gb, h100-sxm, h100-pcie, h800,
    h200, b200, cpu)."""
    if name == "cpu":
        return _cpu()
    try:
        return _ACCELERATORS[name]
    except KeyError:
        raise PipewrightError(
            f"unknown GPU kind {name!r}; choose one of: {', '.join(accelerator_names())}"
        ) from None


def link(name: str) -> Link:
    """The link kind called ``name`` (nvlink2/3/4, pcie3/4/5, ib-hdr, ib-ndr, eth-100g, eth-25g,
    gloo-loopback; "hdr", "ndr", "ethernet-100g", "ethernet-25g" are accepted as aliases)."""
    try:
        return _LINKS[_LINK_ALIASES.get(name, name)]
    except KeyError:
        raise PipewrightError(f"unknown link kind {name!r}; choose one of: {', '.join(_LINKS)}") from None
