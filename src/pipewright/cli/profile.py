"""``pipewright profile``: measure a GPT's per-layer F, B, I, W, optimizer-step and message times on this
machine and write the profile CSV that ``ProfiledCost`` (``pipewright simulate --profile``) and
``pipewright train --compare-sim --profile`` read; or, with ``--calibration OUT``, this accelerator's GEMM
throughput by shape, memory bandwidth and links for ``simulate``/``plan --calibration``. See
docs/profiling.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipewright.outputs import add_overwrite_flag

_MODEL_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--model", str, "preset (default gpt-small-cpu) or family gpt"),
    ("--layers", int, "transformer layers (recorded; times are per layer)"),
    ("--hidden", int, "hidden size h"),
    ("--heads", int, "attention heads"),
    ("--ffn-hidden", int, "MLP hidden size (default 4h)"),
    ("--vocab", int, "vocabulary size (default: the preset's)"),
    ("--seq-len", int, "sequence length"),
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("profile", help="measure per-layer action times for the simulator")
    for flag, kind, text in _MODEL_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--microbatch-size", type=int, nargs="+", default=[8], help="sequences per microbatch (several ok)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (spawns tp processes)")
    parser.add_argument(
        "--workers",
        type=int,
        help="processes measuring at once (default tp); the run's process count includes their contention",
    )
    parser.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="also measure how n = 1..N busy processes slow each other on this CPU (the simulator's "
        "core sharing; use the run's process count)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="the run's compute dtype: the layers and the boundary message are timed in it",
    )
    parser.add_argument("--repeats", type=int, default=10, help="measurements per value (median)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured runs before the repeats")
    parser.add_argument("--optimizer", default="adamw", help="optimizer whose step is timed")
    parser.add_argument(
        "--cpu-allocator",
        default="retain",
        choices=("retain", "system"),
        help="how the workers keep freed tensor memory, as `train --cpu-allocator` (default retain)",
    )
    parser.add_argument("--out", help="profile file to write (.csv or .json)")
    parser.add_argument(
        "--calibration",
        metavar="OUT",
        help="instead of a profile, write a calibration JSON: GEMM time by the model's shapes, memory "
        "bandwidth, and with --nproc N ≥ 2 (or under torchrun) link bandwidth and latency",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="with --calibration: processes to spawn for the links (default 1)",
    )
    parser.add_argument(
        "--gpu", help="with --calibration: the hardware preset of this GPU when its name maps to none"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_overwrite_flag(parser)
    parser.set_defaults(func=_profile)


def _calibrate(args: argparse.Namespace, spec) -> int:
    from pipewright.runtime.profiling.measure_calibration import (
        CalibrationOptions,
        calibrate,
        write_calibration,
    )

    options = CalibrationOptions(
        spec,
        tuple(args.microbatch_size),
        tp=args.tp,
        device=args.device,
        gpu=args.gpu,
        repeats=args.repeats,
        warmup=args.warmup,
        processes=args.nproc,
    )
    data = calibrate(options)
    if data is None:  # a torchrun rank other than 0
        return 0
    path = write_calibration(args.calibration, data)
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
    from pipewright.cli.guards import check_profile
    from pipewright.errors import ConfigError

    check_profile(args)  # output writable, numbers in range, memory: before measuring
    from pipewright.models.presets import resolve_model
    from pipewright.runtime.profiling.profiler import ProfileOptions, profile_model, write_profile

    if (args.out is None) == (args.calibration is None):
        raise ConfigError(
            "pipewright profile needs --out FILE (a profile) or --calibration FILE, one of them"
        )
    spec = resolve_model(
        args.model or "gpt-small-cpu",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        ffn_hidden=args.ffn_hidden,
        vocab=args.vocab,
        seq_len=args.seq_len,
    )
    if args.calibration is not None:
        return _calibrate(args, spec)
    options = ProfileOptions(
        spec,
        tuple(args.microbatch_size),
        tp=args.tp,
        device=args.device,
        repeats=args.repeats,
        warmup=args.warmup,
        optimizer=args.optimizer,
        progress=args.progress,
        workers=args.workers,
        contention=args.contention,
        cpu_allocator=args.cpu_allocator,
        precision=args.precision,
    )
    rows, meta = profile_model(options)
    path = write_profile(args.out, rows, meta)
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
