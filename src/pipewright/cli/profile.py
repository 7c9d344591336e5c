"""``pipewright profile``: measure a GPT's per-layer F, B, I, W, optimizer-step and message times on this
machine and write the profile CSV that ``ProfiledCost`` (``pipewright simulate --profile``) and
``pipewright train --compare-sim --profile`` read; or, with ``--calibration OUT``, this accelerator's GEMM
throughput by shape, memory bandwidth and links for ``simulate``/``plan --calibration``. See
docs/profiling.md."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipewright.models.spec import ModelSpec
    from pipewright.runspec import RunSpec


def register(sub: argparse._SubParsersAction) -> None:
    from pipewright.cli.spec_args import add_command

    add_command(sub, "profile", _profile, help="measure per-layer action times for the simulator")


def _calibrate(run: RunSpec, spec: ModelSpec) -> int:
    from pipewright.runtime.profiling.measure_calibration import (
        CalibrationOptions,
        calibrate,
        write_calibration,
    )

    p = run.profiling
    options = CalibrationOptions(
        spec,
        tuple(p.microbatch_sizes),
        tp=run.parallelism.tp,
        device=run.cluster.device,
        gpu=run.cluster.gpu,
        repeats=p.repeats,
        warmup=p.warmup,
        processes=run.cluster.nproc,
    )
    data = calibrate(options)
    if data is None:  # a torchrun rank other than 0
        return 0
    path = write_calibration(p.calibration, data)
    best = max(data["gemm"], key=lambda g: g["tflops"])
    print(
        f"calibration of {data['device_name']} ({data['accelerator']}, {data['dtype']}) written to {path}: "
        f"{len(data['gemm'])} GEMM shapes (best {best['tflops']:.2f} TFLOP/s at {best['m']}×{best['n']}×"
        f"{best['k']}), memory {data['memory_bandwidth'] / 1e9:.1f} GB/s"
    )
    for name, link in data.get("links", {}).items():
        print(f"  {name}: {link['bandwidth'] / 1e9:.2f} GB/s, latency {link['latency'] * 1e6:.1f} µs")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from pipewright.cli.guards import check_profile, profiled_model
    from pipewright.errors import ConfigError

    run = args.spec
    check_profile(run)  # output writable, numbers in range, memory: before measuring
    from pipewright.runtime.profiling.profiler import ProfileOptions, profile_model, write_profile

    p, out = run.profiling, run.output.out
    if (out is None) == (p.calibration is None):
        raise ConfigError(
            "pipewright profile needs --out FILE (a profile) or --calibration FILE, one of them"
        )
    spec = profiled_model(run)
    if p.calibration is not None:
        return _calibrate(run, spec)
    options = ProfileOptions(
        spec,
        tuple(p.microbatch_sizes),
        tp=run.parallelism.tp,
        device=run.cluster.device,
        repeats=p.repeats,
        warmup=p.warmup,
        optimizer=run.training.optimizer,
        progress=run.output.progress,
        workers=p.workers,
        contention=p.contention,
        cpu_allocator=run.memory.cpu_allocator,
        precision=run.precision.precision,
    )
    rows, meta = profile_model(options)
    path = write_profile(out, rows, meta)
    print(f"profile of {spec.name} ({len(rows)} rows) written to {Path(path)}")
    for b in options.microbatch_sizes:
        per = {(r.layer_type, r.kind): r.seconds for r in rows if r.microbatch_size == b}
        print(
            f"  b={b}: layer F {per['layer', 'F'] * 1e3:.3f} ms, B {per['layer', 'B'] * 1e3:.3f} ms "
            f"(I {per['layer', 'I'] * 1e3:.3f} + W {per['layer', 'W'] * 1e3:.3f}), "
            f"message {per['layer', 'MESSAGE'] * 1e3:.3f} ms"
        )
    if "contention" in meta:
        curve = ", ".join(f"s({n})={x}" for n, x in enumerate(str(meta["contention"]).split(","), 1))
        print(f"  contention (time of the same work with n processes busy, relative to one): {curve}")
    return 0
