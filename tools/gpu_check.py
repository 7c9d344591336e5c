"""The checks ``tools/gpu_check.sh`` runs on a machine with 1–8 GPUs, and the table it prints.

``python tools/gpu_check.py plan --gpus N --out DIR [--device cuda|cpu]`` prints one check per line,
``name<TAB>timeout seconds<TAB>command`` (the command a shell runs from the repository root);
``python tools/gpu_check.py table DIR`` reads ``DIR/results.tsv`` (``name<TAB>exit status<TAB>seconds``,
one line per check run) and the checks' output folders and prints one table: status, seconds, and
the number each check is for — the profile's rows, every schedule's median step time, ``check``'s
verdict, the MFU of a single-GPU step, the simulator's step time against the measured one.

The checks:

- ``calibration``: ``pipewright profile --device cuda --calibration`` (GEMM throughput by the model's
  shapes, memory bandwidth, links with two GPUs);
- ``profile``: ``pipewright profile --device cuda`` in bf16 (the per-action profile ``--compare-sim``
  reads);
- ``train:<schedule>``: every registered schedule at pp = 2 (tp = 2 as well with four GPUs or
  more) for 3 steps in bf16 — 2 GPUs at least;
- ``check``: ``pipewright check`` at pp = 2 (pipelined against one process) — 2 GPUs at least;
- ``mfu``: one GPU, pp = 1, 6 steps: model FLOPs per step (Narayanan et al. 2021, without
  recomputation: 72·b·s·L·h²·(1 + s/(6h) + V/(12·L·h))) over the median step time, against the
  preset's dense bf16 peak of the calibrated accelerator;
- ``compare``: ``train --compare-sim --profile`` at pp = 2: the simulator's step time over the measured
  one — 2 GPUs at least.

``--device cpu`` plans the same checks on the CPU (gloo, fp32, a tiny model) so that the script can
be exercised where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

#: The model every check trains (GPU): big enough for real GEMMs, small enough for 8 minutes.
GPU_MODEL = ("--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "1024",
             "--vocab", "32000")  # fmt: skip
CPU_MODEL = ("--model", "gpt", "--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "32",
             "--vocab", "256")  # fmt: skip
SCHEDULE_TIMEOUT_S = 90


def _schedule_args(name: str) -> tuple[str, ...]:
    """``--virtual v --microbatches m`` for ``name`` at pp = 2: the first (v, m) its rules accept, two
    chunks per rank first (the interleaved and V schedules run as they are meant to)."""
    from pipewright.errors import PipewrightError
    from pipewright.schedules.registry import check_args

    for v in (2, 1):
        for m in (4, 8):
            try:
                check_args(name, 2, m, v)
            except PipewrightError:
                continue
            return ("--virtual", str(v), "--microbatches", str(m))
    raise SystemExit(f"schedule {name} accepts no (virtual, microbatches) in (2, 1) × (4, 8) at pp 2")


def plan(gpus: int, out: str, device: str = "cuda") -> list[tuple[str, int, list[str]]]:
    """(name, timeout seconds, argv) of every check for ``gpus`` devices (module docstring)."""
    from pipewright.schedules.registry import schedule_names

    cuda = device == "cuda"
    model = GPU_MODEL if cuda else CPU_MODEL
    precision = ("--precision", "bf16") if cuda else ("--precision", "fp32")
    run = ("--no-progress", "--eval-every", "0", *precision, *model)
    pw = [sys.executable, "-m", "pipewright"]
    checks: list[tuple[str, int, list[str]]] = [
        (
            "calibration",
            120,
            [*pw, "profile", "--device", device, *model, "--calibration", f"{out}/calibration.json",
             "--nproc", str(min(gpus, 2)), "--no-progress"],
        ),
        (
            "profile",
            120,
            [*pw, "profile", "--device", device, *precision, *model, "--microbatch-size", "1",
             "--repeats", "5", "--out", f"{out}/profile.csv", "--no-progress"],
        ),
    ]  # fmt: skip
    tp = 2 if gpus >= 4 else 1
    if gpus >= 2:
        for name in schedule_names():
            checks.append(
                (
                    f"train:{name}",
                    SCHEDULE_TIMEOUT_S,
                    [*pw, "train", "--pp", "2", "--tp", str(tp), "--schedule", name, *_schedule_args(name),
                     "--steps", "3", "--warmup", "1", *run, "--out", f"{out}/train-{name}"],
                )
            )  # fmt: skip
        checks.append(("check", 120, [*pw, "check", "--pp", "2", "--steps", "2", *model, "--no-progress"]))
    checks.append(
        (
            "mfu",
            90,
            [*pw, "train", "--pp", "1", "--steps", "6", "--warmup", "1", *run, "--out", f"{out}/mfu"],
        )
    )
    if gpus >= 2:
        checks.append(
            (
                "compare",
                150,
                [*pw, "train", "--pp", "2", "--schedule", "1f1b", "--microbatches", "8", "--steps", "8",
                 "--warmup", "1", *run, "--compare-sim", "--profile", f"{out}/profile.csv",
                 "--out", f"{out}/compare"],
            )
        )  # fmt: skip
    return checks


# ------------------------------------------------------------------------------------------ table


def _step_time(folder: Path, skip: int = 1) -> float | None:
    """Median ``step_time_s`` of ``folder/metrics.jsonl`` after the first ``skip`` steps."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][skip:]
    return statistics.median(times) if times else None


def flops_per_token(config: dict) -> float:
    """Narayanan et al. (2021)'s training FLOPs per token without recomputation:
    72·L·h²·(1 + s/(6h) + V/(12·L·h)) (``config``: the run's ``config.json``)."""
    layers, h, s, vocab = config["layers"], config["hidden"], config["seq_len"], config["vocab"]
    return 72 * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))


def _mfu(out: Path) -> str:
    """Model FLOP/s of the single-GPU run (median tokens/s after its first step) over the calibrated
    accelerator's dense peak (bf16; fp32 on the CPU)."""
    folder, calib = out / "mfu", out / "calibration.json"
    metrics, config = folder / "metrics.jsonl", folder / "config.json"
    if not (metrics.exists() and config.exists() and calib.exists()):
        return "n/a (no metrics, config or calibration)"
    from pipewright.hardware import accelerator

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1:]
    if not rates:
        return "n/a (fewer than two steps)"
    accel = json.loads(calib.read_text())["accelerator"]
    peak = accelerator(accel).peak("fp32" if accel == "cpu" else "bf16")
    mfu = flops_per_token(json.loads(config.read_text())) * statistics.median(rates) / peak
    return f"MFU {100 * mfu:.1f}% ({statistics.median(rates):,.0f} tokens/s on {accel})"


def _number(name: str, out: Path) -> str:
    """The number a check is for (module docstring), read from its output."""
    if name == "calibration" and (out / "calibration.json").exists():
        data = json.loads((out / "calibration.json").read_text())
        return f"{data.get('device_name', '?')} ({data.get('accelerator', '?')})"
    if name == "profile" and (out / "profile.csv").exists():
        rows = [x for x in (out / "profile.csv").read_text().splitlines() if x and not x.startswith("#")]
        return f"{len(rows) - 1} rows"
    if name.startswith("train:"):
        step = _step_time(out / f"train-{name.split(':', 1)[1]}")
        return "" if step is None else f"{step * 1e3:.1f} ms/step"
    if name == "mfu":
        return _mfu(out)
    if name == "compare" and (out / "compare" / "compare.json").exists():
        report = json.loads((out / "compare" / "compare.json").read_text())
        measured, predicted = report["measured"]["step_time_s"], report["predicted"]["step_time_s"]
        return f"sim {predicted * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms (×{report['ratio']:.2f})"
    return ""


def table(out: Path) -> str:
    """The one table of every check run (``out/results.tsv``) and its number."""
    lines = [f"{'check':<26} {'status':<10} {'seconds':>8}  result", "-" * 90]
    results = out / "results.tsv"
    for line in results.read_text().splitlines() if results.exists() else []:
        name, rc, seconds = line.split("\t")[:3]
        status = {"0": "ok", "124": "timeout", "skip": "skipped"}.get(rc, f"failed {rc}")
        number = _number(name, out) if rc == "0" else _first_error(out / "logs" / f"{_slug(name)}.log")
        lines.append(f"{name:<26} {status:<10} {seconds:>8}  {number}")
    return "\n".join(lines)


def _slug(name: str) -> str:
    return name.replace(":", "-")


def _first_error(log: Path) -> str:
    """The last line of a failed check's log that reads as an error (or its last line)."""
    if not log.exists():
        return ""
    text = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in text if "error" in x.lower()]
    return (errors or text or [""])[-1][:100]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    t = sub.add_parser("table")
    t.add_argument("out")
    args = parser.parse_args(argv)
    if args.what == "plan":
        for name, timeout, argv_ in plan(args.gpus, args.out, args.device):
            print(f"{name}\t{timeout}\t{shlex.join(argv_)}")
    else:
        print(table(Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
