"""``pipewright check``: a layout against one process. Trains a few steps with the given model, layout and
schedule (``train``'s flags), then the same model on one process (pp = dp = tp = 1, the same global
batch as one run of m·dp microbatches, same data and seeds, no ``--compile``), and compares per step

- the loss: |ℓ_pipe − ℓ_one| / |ℓ_one|;
- the global gradient norm before clipping, likewise;
- the parameters after the step: √(Σ_p (Δ‖θ_p‖² + Δ(w·θ_p)²/‖w‖²)) / √(Σ_p ‖θ_p‖²) over every
  parameter p of the one-process model, with w = linspace(−1, 1) a fixed weighting (two numbers per
  tensor cross the processes, not the tensors; tensor-parallel shards are gathered first).

A step passes when all three are within the tolerance of the run's precision (:data:`TOLERANCE`, or
``--tolerance``). The exit status is 1 at the first step that does not, named in the last line (0: all
equal). See docs/training.md, "Checking a layout against one process".
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipewright.errors import ConfigError
from pipewright.runtime.setup.startup import stage

#: Relative tolerance by ``--precision``: fp32 leaves summation-order rounding (AdamW's 1/√v can amplify
#: it in parameters whose gradient is noise, hence above 1e-5); bf16 and fp16 round each activation.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
DEFAULT_STEPS = 3
#: train's settings about the run folder and restarts, which a check (two throw-away runs) refuses.
_NOT_FOR_CHECK = (
    ("output", "out"),
    ("training", "checkpoints", "resume"),
    ("output", "overwrite"),
    ("training", "checkpoints", "stop_after"),
    ("training", "checkpoints", "max_restarts"),
    ("training", "checkpoints", "every"),
)


def register(sub: argparse._SubParsersAction, feature_paths: tuple[str, ...] = ()) -> None:
    from pipewright.cli.spec_args import add_command
    from pipewright.features import all_features
    from pipewright.runspec import feature_sections

    add_command(
        sub,
        "check",
        _check,
        feature_sections(all_features(feature_paths)),
        help="train a few steps pipelined and on one process; compare",
    )


def _check(args: argparse.Namespace) -> int:
    from pipewright.cli.train import config_from_args, measure_args
    from pipewright.runspec.run import spec_fields
    from pipewright.training.run_inputs import run_spec

    _spec, chosen = run_spec(args.spec, args.given, "check", args.train_toml)
    given = [p for p in _NOT_FOR_CHECK if p in chosen]
    if given:
        flag = next(f.metadata["flag"] for p, f, _ in spec_fields({}) if p == given[0])
        raise ConfigError(f"{flag} does not apply to check (it keeps no run folder); drop it")
    config = config_from_args(args, "check")
    asked = measure_args(args.spec)
    if asked is not None:  # no training: cli/measure.py
        from pipewright.cli.measure import measure

        return measure(config, asked)
    if ("training", "steps") not in chosen:
        config = replace(config, steps=DEFAULT_STEPS)
    if ("training", "warmup") not in chosen:  # a few steps at the peak learning rate: differences show sooner
        config = replace(config, warmup=0)
    given_tol = args.spec.simulation.tolerance
    tol = TOLERANCE[config.precision] if given_tol is None else given_tol
    if not tol > 0:
        raise ConfigError(f"--tolerance must be positive (got {given_tol})")
    hf = None
    with tempfile.TemporaryDirectory(prefix="pipewright-check-") as tmp:
        if config.hf_model:
            from pipewright.cli.check_hf import transformers_rows, without_dropout

            path, dropped = without_dropout(config.hf_model, Path(tmp) / "hf")
            config = replace(config, hf_model=path)
            if dropped:
                print(f"dropout disabled for the comparison ({', '.join(dropped)} set to 0)")
        piped, one = run_both(config, Path(tmp))
        if config.hf_model:
            hf = transformers_rows(config)
    rows = compare(piped, one, tol)
    print(table(rows, config, tol))
    bad = next((r for r in rows if not r["ok"]), None)
    status = 0
    if bad is None:
        print(f"equal: {len(rows)} steps within {tol:g} ({config.precision}) of one process")
    else:
        print(f"differs from one process at step {bad['step']}: {bad['why']}")
        status = 1
    if hf is not None:
        status = max(status, _report_transformers(piped, hf, config, tol))
    return status


def _report_transformers(piped: list[dict], hf: tuple[dict, list[dict]], config: Any, tol: float) -> int:
    """The comparison with ``transformers``' own model (cli/check_hf.py): the first batch, then the
    steps; 1 at the first that differs, named in the last line."""
    from pipewright.cli.check_hf import first_batch_verdict

    first, steps = hf
    print(
        f"transformers' forward on the first batch: logits relative difference {first['logits']:.1e}, "
        f"loss {first['loss_ours']:.6g} (pipewright) vs {first['loss']:.6g} (transformers)"
    )
    why = first_batch_verdict(first, tol)
    if why is not None:
        print(f"differs from transformers at the first batch (before step 0): {why}")
        return 1
    rows = compare(piped, steps, tol)
    print(table(rows, config, tol).replace("vs one process", "vs transformers' model in one process", 1))
    bad = next((r for r in rows if not r["ok"]), None)
    if bad is None:
        print(f"equal: {len(rows)} steps within {tol:g} ({config.precision}) of transformers")
        return 0
    print(f"differs from transformers at step {bad['step']}: {bad['why']}")
    return 1


def reference_config(config: Any, out: Path) -> Any:
    """The same model, data and seeds on one process: pp = dp = tp = cp = ep = 1, m·dp microbatches
    (the same global batch), the default schedule and layout, no ZeRO-1, no compilation."""
    return replace(
        config,
        pp=1, dp=1, tp=1, cp=1, ep=1, virtual=None, layout=None, schedule="1f1b", placement=None,
        microbatches=config.microbatches * config.dp, sequence_parallel=False, scatter_gather=False,
        shard_optimizer=False, compile=False, out=str(out), resume=False, overwrite=True,
        eval_every=0, artifacts=False, progress=False, checkpoint_every=0, max_restarts=0,
    )  # fmt: skip


def refuse_unlike_reference(run: Any) -> None:
    """One line for a layout whose one-process run is another algorithm, so "differs" would say nothing:
    an asynchronous schedule (each microbatch meets other weights than one synchronous step's), and
    K-FAC with ``--kfac-fill measured`` (which factor pieces run in a step depends on measured bubble
    lengths; ``--kfac-fill all`` runs every piece, on one process as in the pipeline)."""
    from pipewright.features.kfac.options import KfacOptions
    from pipewright.options import section_of

    c = run.config
    if not run.schedule.meta.get("flush", True):
        raise ConfigError(
            f"check compares synchronous steps; the asynchronous schedule {run.schedule.name} updates "
            "weights between microbatches, so one process is not the same algorithm: use a flushing "
            "schedule (e.g. --schedule 1f1b)"
        )
    if c.optimizer == "kfac" and section_of(c, KfacOptions).fill != "all":
        raise ConfigError(
            "check --optimizer kfac needs --kfac-fill all: with measured fill the K-FAC work done in a "
            "step depends on the bubbles' timing, which one process does not have"
        )


def run_both(config: Any, tmp: Path) -> tuple[list[dict], list[dict]]:
    """Per-step records (loss, grad_norm, params: name → (‖θ‖, w·θ, ‖w‖)) of the pipelined run and of
    the one-process run."""
    from pipewright.training import prepare
    from pipewright.training.workers import launcher

    piped = replace(
        config, out=str(tmp / "pipelined"), resume=False, overwrite=True, eval_every=0, artifacts=False,
        progress=False, checkpoint_every=0, max_restarts=0,
    )  # fmt: skip
    with stage("checking the layout and the data"):  # both runs, before either starts
        runs = [prepare(c) for c in (piped, reference_config(config, tmp / "one"))]
    refuse_unlike_reference(runs[0])
    out = [launcher()(check_worker, r.config.world_size, (r,), timeout_s=24 * 3600)[0] for r in runs]
    return out[0], out[1]


def check_worker(rank: int, run: Any) -> list[dict] | None:
    """Train ``run.config.steps`` steps; after each, rank 0 collects every parameter's statistics."""
    import torch
    import torch.distributed as dist

    from pipewright.cli.check_hf import param_stats
    from pipewright.runtime.core.trainer import Trainer
    from pipewright.runtime.parallel.tp import full_parameters

    torch.manual_seed(run.config.seed + rank)
    with stage("building the model", enabled=rank == 0):
        trainer = Trainer(run)
    rows = []
    for step in range(run.config.steps):
        with stage(f"step 1 of {run.config.steps}", enabled=rank == 0 and step == 0):
            record = trainer.train_step(step)
        stats = {}
        for module in trainer.stages.values():
            for name, p in full_parameters(module).items():
                stats[name] = param_stats(p)
        if trainer.mesh.dp_rank >= trainer.mesh.ep or trainer.mesh.tp_rank:  # the first ep dp ranks
            stats = {}  # hold every expert between them (global names); the rest are replicas
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(stats, gathered, dst=0)
        if rank == 0:
            merged = {k: v for part in gathered for k, v in part.items()}
            rows.append(
                {"step": step, "loss": record["loss"], "grad_norm": record["grad_norm"], "params": merged}
            )
    trainer.guard.close()
    return rows if rank == 0 else None


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def param_difference(got: dict[str, tuple], want: dict[str, tuple]) -> float:
    """The relative parameter difference of the module docstring (parameters the one-process model
    lacks — the output layer's copy of a tied embedding — are left out; a missing one counts as 0)."""
    num = den = 0.0
    for name, (norm, dot, wnorm) in want.items():
        g_norm, g_dot, _ = got.get(name, (0.0, 0.0, wnorm))
        num += (g_norm - norm) ** 2 + ((g_dot - dot) / max(wnorm, 1e-300)) ** 2
        den += norm**2
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def compare(piped: list[dict], one: list[dict], tol: float) -> list[dict]:
    """Per step: both values, the relative differences and the verdict (``why``: the first quantity out
    of tolerance)."""
    rows = []
    for a, b in zip(piped, one, strict=True):
        diffs = {
            "loss": _rel(a["loss"], b["loss"]),
            "gradient norm": _rel(a["grad_norm"], b["grad_norm"]),
            "parameters": param_difference(a["params"], b["params"]),
        }
        values = {"loss": (a["loss"], b["loss"]), "gradient norm": (a["grad_norm"], b["grad_norm"])}
        why = next(
            (
                f"{k} {values[k][0]:.6g} vs {values[k][1]:.6g} (relative difference {d:.1e} > {tol:g})"
                if k in values
                else f"parameters differ by {d:.1e} (relative, > {tol:g})"
                for k, d in diffs.items()
                if not d <= tol
            ),
            None,
        )
        rows.append({"step": a["step"], "a": a, "b": b, "diffs": diffs, "ok": why is None, "why": why})
    return rows


def table(rows: list[dict], config: Any, tol: float) -> str:
    """The per-step comparison as text."""
    v = f" v={config.virtual}" if config.virtual else ""
    v += f" cp={config.cp}" if config.cp > 1 else ""
    v += f" ep={config.ep}" if config.ep > 1 else ""
    head = (
        f"{config.schedule} pp={config.pp} dp={config.dp} tp={config.tp}{v} vs one process, "
        f"{config.precision}, tolerance {tol:g}"
    )
    lines = [head, f"{'step':>4}  {'loss':>12} {'(one)':>12} {'rel':>8}  {'grad norm':>12} {'(one)':>12} "
             f"{'rel':>8}  {'params rel':>10}  verdict"]  # fmt: skip
    for r in rows:
        a, b, d = r["a"], r["b"], r["diffs"]
        lines.append(
            f"{r['step']:>4}  {a['loss']:>12.6g} {b['loss']:>12.6g} {d['loss']:>8.1e}  "
            f"{_num(a['grad_norm'])} {_num(b['grad_norm'])} {d['gradient norm']:>8.1e}  "
            f"{d['parameters']:>10.1e}  {'ok' if r['ok'] else 'DIFFERS'}"
        )
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return f"{'skipped':>12}" if x is None else f"{x:>12.6g}"
