"""``pipewright profile --calibration OUT``: measure this accelerator for the cost model.

What is measured (the file's format is :mod:`pipewright.cost.calibration`'s, ``pipewright-calibration/1``):

- **GEMM time by shape**: the transformer's own matrix products for the model's hidden size h, ffn
  width f, vocabulary V and tokens b·s per microbatch, split t ways — forward QKV (bs × 3h/t × h),
  attention output (bs × h × h/t), MLP up (bs × f/t × h) and down (bs × h × f/t), output layer
  (bs × V/t × h), and the weight-gradient products (h × 3h/t × bs, f/t × h × bs); each the median of
  ``repeats`` timed runs after ``warmup`` (bf16 on CUDA, timed with CUDA events; fp32 on CPU, one
  thread). ``tflops`` = 2·m·n·k / seconds / 10¹².
- **Memory bandwidth**: a copy of a large buffer (``bandwidth_bytes``, default 1 GiB on CUDA, 64 MiB on
  CPU) reads and writes it: 2·bytes / seconds.
- **Links**, with ``processes`` ≥ 2 (spawned here; gloo on CPU, NCCL on CUDA) or under ``torchrun``:
  ping-pong between rank 0 and rank 1 (``intra_node``) and, when ``LOCAL_WORLD_SIZE`` < the world,
  rank 0 and the first rank of the next node (``inter_node``): latency = half the round trip of one
  element, bandwidth = bytes / (half the round trip of ``link_bytes`` − latency).

The accelerator is named by its :mod:`pipewright.hardware` preset: ``torch.cuda.get_device_name()``
mapped through :data:`DEVICE_PRESETS` (or ``--gpu NAME``); an unknown device is a one-line error.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipewright.errors import ConfigError
from pipewright.hardware import accelerator_names
from pipewright.models.spec import ModelSpec

FORMAT = "pipewright-calibration/1"

#: (words that all appear in ``torch.cuda.get_device_name()``, lowercased) → hardware preset, first
#: match wins; extend by adding a row.
DEVICE_PRESETS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("h200",), "h200"),
    (("b200",), "b200"),
    (("a100", "80gb"), "a100-80gb"),
    (("a100",), "a100-40gb"),
    (("v100",), "v100"),
)


def preset_for(device_name: str, given: str | None = None) -> str:
    """The hardware preset of a device: ``given`` (``--gpu``) when it names one, else the first
    :data:`DEVICE_PRESETS` row whose words all appear in ``device_name``."""
    known = accelerator_names()
    if given is not None:
        if given not in known:
            raise ConfigError(f"--gpu {given!r} is not a known accelerator; choose one of {', '.join(known)}")
        return given
    name = device_name.lower()
    for words, preset in DEVICE_PRESETS:
        if all(w in name for w in words) and preset in known:
            return preset
    raise ConfigError(
        f"device {device_name!r} matches no accelerator preset; pass --gpu NAME ({', '.join(known)})"
    )


def gemm_shapes(
    spec: ModelSpec, microbatch_sizes: tuple[int, ...], tp: int = 1
) -> list[tuple[int, int, int]]:
    """The (m, n, k) products of one transformer layer and the output layer (module docstring), per
    microbatch size, without repeats, in order."""
    h, f, v = spec.hidden, spec.ffn_hidden, spec.vocab
    shapes: list[tuple[int, int, int]] = []
    for b in microbatch_sizes:
        bs = b * spec.seq_len
        for shape in (
            (bs, 3 * h // tp, h),
            (bs, h, h // tp),
            (bs, f // tp, h),
            (bs, h, f // tp),
            (bs, -(-v // tp), h),
            (h, 3 * h // tp, bs),
            (f // tp, h, bs),
        ):
            if shape not in shapes and min(shape) > 0:
                shapes.append(shape)
    return shapes


@dataclass(frozen=True)
class CalibrationOptions:
    """What to measure: the model's shapes at ``microbatch_sizes`` split ``tp`` ways on ``device``."""

    spec: ModelSpec
    microbatch_sizes: tuple[int, ...] = (1,)
    tp: int = 1
    device: str = "cpu"
    gpu: str | None = None  # the hardware preset, if the device name does not map to one
    repeats: int = 10
    warmup: int = 2
    processes: int = 1  # ≥ 2: also the links
    bandwidth_bytes: int | None = None
    link_bytes: int = 16 << 20

    def check(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device!r})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but CUDA is not available here; use --device cpu")
        for name in ("repeats", "processes", "tp", "link_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})"
                )
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more (got {self.warmup})")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of a function takes on ``device`` (CUDA events on a GPU, the clock on a CPU)."""
    if device == "cuda":

        def cuda_time(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def cpu_time(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu_time


def _median(fn: Callable[[], object], options: CalibrationOptions) -> float:
    timer = _timer(options.device)
    for _ in range(options.warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(options.repeats))


def measure_gemms(options: CalibrationOptions) -> list[dict[str, object]]:
    """One entry per shape of :func:`gemm_shapes`: m, n, k, dtype, seconds, tflops."""
    dtype_name = "bf16" if options.dtype == torch.bfloat16 else "fp32"
    out = []
    for m, n, k in gemm_shapes(options.spec, options.microbatch_sizes, options.tp):
        a = torch.randn(m, k, device=options.device, dtype=options.dtype)
        b = torch.randn(k, n, device=options.device, dtype=options.dtype)
        c = torch.empty(m, n, device=options.device, dtype=options.dtype)
        seconds = _median(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), options)
        out.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "dtype": dtype_name,
                "seconds": seconds,
                "tflops": 2 * m * n * k / seconds / 1e12,
            }
        )
    return out


def measure_bandwidth(options: CalibrationOptions) -> float:
    """Bytes/s of a large copy (read + write)."""
    nbytes = options.bandwidth_bytes or ((1 << 30) if options.device == "cuda" else (64 << 20))
    src = torch.ones(nbytes // 4, device=options.device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median(lambda: dst.copy_(src), options)


def _ping_pong(peer: int, elems: int, first: bool, options: CalibrationOptions) -> float:
    """Half the median round trip of a float32 tensor of ``elems`` elements between this rank and
    ``peer`` (0.0 on the echoing side)."""
    buf = torch.zeros(elems, device=options.device)
    samples = []
    for i in range(options.warmup + options.repeats):
        if first:
            t0 = time.perf_counter()
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
            if options.device == "cuda":
                torch.cuda.synchronize()
            if i >= options.warmup:
                samples.append((time.perf_counter() - t0) / 2)
        else:
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)
    return statistics.median(samples) if first else 0.0


def measure_links(rank: int, world: int, local_world: int, options: CalibrationOptions) -> dict[str, dict]:
    """``{"intra_node": …, "inter_node": …}`` as far as the ranks reach (rank 0 gets the figures)."""
    pairs = {"intra_node": 1} if local_world > 1 else {}
    if world > local_world:
        pairs["inter_node"] = local_world
    links = {}
    for name, peer in pairs.items():
        dist.barrier()
        if rank not in (0, peer):
            continue
        latency = _ping_pong(peer if rank == 0 else 0, 1, rank == 0, options)
        big = _ping_pong(peer if rank == 0 else 0, options.link_bytes // 4, rank == 0, options)
        if rank == 0:
            links[name] = {"bandwidth": options.link_bytes / max(big - latency, 1e-12), "latency": latency}
    dist.barrier()
    return links


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores, torch {torch.__version__.split('+')[0]})"


def _measure(rank: int, world: int, local_world: int, options: CalibrationOptions) -> dict | None:
    """Every measurement of one rank; the calibration on rank 0 (a single process: rank 0, world 1)."""
    if options.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)
    links = measure_links(rank, world, local_world, options) if world > 1 else {}
    if rank != 0:
        return None
    name = device_name(options.device)
    return {
        "format": FORMAT,
        "accelerator": "cpu" if options.device == "cpu" else preset_for(name, options.gpu),
        "device_name": name,
        "dtype": "bf16" if options.dtype == torch.bfloat16 else "fp32",
        "measured_at": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "torch": torch.__version__.split("+")[0],
        "gemm": measure_gemms(options),
        "memory_bandwidth": measure_bandwidth(options),
        **({"links": links} if links else {}),
    }


def _spawned(rank: int, options: CalibrationOptions) -> dict | None:
    return _measure(rank, options.processes, options.processes, options)


def calibrate(options: CalibrationOptions) -> dict:
    """The calibration (module docstring): in this process, in ``options.processes`` spawned ones, or
    across the ranks of a ``torchrun`` launch (rank 0 returns it, the others None)."""
    options.check()
    if options.device == "cuda":
        preset_for(device_name("cuda"), options.gpu)  # an unknown GPU stops before measuring
    from pipewright.runtime.setup.launch import init_from_env, running_under_torchrun, spawn

    if running_under_torchrun():
        backend = "nccl" if options.device == "cuda" else "gloo"
        init_from_env(backend, 600.0)
        try:
            world = dist.get_world_size()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            return _measure(dist.get_rank(), world, local, options)
        finally:
            dist.destroy_process_group()
    if options.processes == 1:
        return _measure(0, 1, 1, options)
    backend = "nccl" if options.device == "cuda" else "gloo"
    return spawn(_spawned, options.processes, (options,), backend=backend, timeout_s=3600)[0]


def write_calibration(path: str | Path, data: dict) -> Path:
    out = Path(path)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out
