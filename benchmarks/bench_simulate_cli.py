"""End-to-end speed of ``pipewright simulate``: lowered actions per CPU-second of the whole command.

    python benchmarks/bench_simulate_cli.py [--rounds 3] [--old-rev main | --old-src DIR] [--split]
        [--schedule interleaved-1f1b --stages 64 --virtual 4 --microbatches 512]

Runs ``python -m pipewright simulate --schedule … --cost unit --json`` as a child process — start-up,
build, validation, lowering, simulation and output — and reads the child's user + sys CPU time from
``resource.getrusage(RUSAGE_CHILDREN)``. With ``--old-rev REV`` (its ``src/`` unpacked by ``git archive``
into a temporary directory) or ``--old-src DIR``, the old and the current code run alternately, round by
round, and their JSON outputs must be equal. Both ``src/`` trees are byte-compiled first (``compileall``,
as an installed package is), so a ``PYTHONDONTWRITEBYTECODE`` environment does not add the compiling of
every module to each run (≈ 0.2 s). "actions" counts the lowered schedule's actions (compute +
send/receive). The machine may be shared: the load average is printed with the figures.

``--split`` also runs the current code once more in a child that times its parts (CPU seconds):
the interpreter alone (``python -c pass``), numpy's import, the other imports, the schedule's generator,
the compile (``sim/compute_compile.py`` from the compute actions, else ``sim/lowered_compile.py``), the
compute-only loop (``sim/fast_loop.py``) and the rest of the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(src: Path, argv: list[str]) -> tuple[float, float, str]:
    """(child CPU s, wall s, stdout) of one ``pipewright simulate`` with ``src`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cpu0, wall0 = _child_cpu(), time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pipewright", "simulate", *argv], env=env, capture_output=True, text=True
    )
    wall, cpu = time.perf_counter() - wall0, _child_cpu() - cpu0
    if out.returncode != 0:
        raise SystemExit(f"{src}: pipewright simulate failed: {out.stderr.strip()}")
    return cpu, wall, out.stdout


def unpack(rev: str, into: Path) -> Path:
    """``src/`` of git revision ``rev`` under ``into``, by ``git archive`` (the checkout is left alone)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], capture_output=True, check=True
    ).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def count_actions(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from pipewright.features import library_schedules
    from pipewright.passes.lower import lower
    from pipewright.schedules import build_schedule

    sched = build_schedule(
        args.schedule, args.stages, args.microbatches, args.virtual, registry=library_schedules()
    )
    return len(lower(sched))


SPLIT = """
import contextlib, io, sys, time
t0 = time.process_time()
import numpy
t1 = time.process_time()
from pipewright.cli import main
import pipewright.cli.simulate as cli_sim, pipewright.sim.engine as engine
spent = {"numpy": t1 - t0, "imports": time.process_time() - t1}  # imports: the others
def timed(mod, name, label):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.process_time()
        try:
            return f(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.process_time() - t
    setattr(mod, name, g)
timed(cli_sim, "build_schedule", "generator")
timed(engine, "compile_fast", "compile")  # (compute_compile, else lowered_compile)
timed(engine, "run_steps", "loop")
t2 = time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[1:])
spent["rest"] = time.process_time() - t2 - sum(v for k, v in spent.items() if k not in ("numpy", "imports"))
print(" ".join(f"{k} {v:.3f}" for k, v in spent.items()))
"""


def split(src: Path, argv: list[str]) -> None:
    """Print where one run's CPU time goes (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cpu0 = _child_cpu()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    bare = _child_cpu() - cpu0
    out = subprocess.run(
        [sys.executable, "-c", SPLIT, "simulate", *argv], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"split run failed: {out.stderr.strip()}")
    print(f"split (CPU s): interpreter {bare:.3f} {out.stdout.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--virtual", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-rev", help="git revision to compare against (e.g. main)")
    parser.add_argument("--old-src", help="a src/ directory of the old code to compare against")
    parser.add_argument("--split", action="store_true", help="also time the current code's parts")
    args = parser.parse_args()
    argv = [
        "--schedule",
        args.schedule,
        "--stages",
        str(args.stages),
        "--microbatches",
        str(args.microbatches),
    ]
    argv += ["--virtual", str(args.virtual), "--cost", "unit", "--json"]
    actions = count_actions(args)
    with tempfile.TemporaryDirectory() as tmp:
        old = (
            Path(args.old_src) if args.old_src else unpack(args.old_rev, Path(tmp)) if args.old_rev else None
        )
        sides = [("new", ROOT / "src")] + ([("old", old)] if old else [])
        for _, src in sides:
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True)
        print(
            f"pipewright simulate {' '.join(argv)}: {actions:,} lowered actions; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        cpu: dict[str, list[float]] = {name: [] for name, _ in sides}
        outputs: dict[str, str] = {}
        for rnd in range(args.rounds):
            for name, src in sides if rnd % 2 == 0 else sides[::-1]:  # alternate which goes first
                c, w, out = run_once(src, argv)
                cpu[name].append(c)
                outputs.setdefault(name, out)
                print(
                    f"round {rnd} {name}: CPU {c:.3f} s (user + sys), wall {w:.3f} s, "
                    f"{actions / c:,.0f} actions/CPU-s"
                )
        if old is not None and json.loads(outputs["old"]) != json.loads(outputs["new"]):
            raise SystemExit("the old and the new code print different reports")
        for name, values in cpu.items():
            best, median = min(values), sorted(values)[len(values) // 2]
            print(
                f"{name}: CPU s {' / '.join(f'{v:.2f}' for v in values)}; best {best:.2f} s = "
                f"{actions / best:,.0f} actions/s, median {median:.2f} s = {actions / median:,.0f} actions/s"
            )
        if old is not None:
            ratios = [o / n for o, n in zip(cpu["old"], cpu["new"], strict=True)]
            print(f"old / new CPU per round: {' '.join(f'{r:.2f}' for r in ratios)}")
        if args.split:
            split(ROOT / "src", argv)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
