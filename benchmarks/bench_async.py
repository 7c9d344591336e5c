"""Convergence and throughput of asynchronous 1F1B weight policies against synchronous 1F1B (CPU).

Every run trains the default small model (``gpt-small-cpu``) on the default corpus at p = 4 with the
same microbatches in the same order: N = steps × m microbatches of b sequences, one optimizer update
per microbatch (``2bw``: per m), the same learning rate per update. The synchronous reference is 1F1B
with one microbatch per step and steps × m steps: the update sequence the asynchronous runs
approximate (PipeOptim's comparison: the same minibatch and learning rate per update for GPipe and the
asynchronous pipelines). ``sync-m`` (m microbatches per step) is the reference of ``2bw``.

Each run is cached as one JSON file in ``benchmarks/results/async/`` (the study resumes where it
stopped); its final *validation* loss is measured on the same held-out batches for every run, from
the final checkpoint loaded into the whole model (consistent weights, after the drain).

    nice -n 10 python benchmarks/bench_async.py                 # the study: 2 optimizers × 3 seeds
    python benchmarks/bench_async.py --report                   # table + docs/img/async-*.png
    python benchmarks/bench_async.py --speed --rounds 3         # throughput, alternating rounds
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "async"
POLICIES = ("none", "stash", "2bw", "predict", "dc", "nesterov")
LR = {"adamw": 1e-3, "sgd": 0.05}  # per-update (one microbatch) learning rates; --lr overrides
VAL_BATCHES, VAL_SEED = 16, 12345  # the held-out set every run is scored on (batches of b sequences)


def _config(opt: str, seed: int, steps: int, out: Path, clip: float, **kw):
    from pipewright.training import config_from_values

    base = dict(
        pp=4,
        steps=steps,
        microbatch_size=8,
        optimizer=opt,
        lr=LR[opt],
        seed=seed,
        eval_every=0,
        progress=False,
        artifacts=False,
        grad_clip=clip,
        out=str(out),
    )
    base.update(kw)
    return config_from_values(base)


def run_config(name: str, opt: str, seed: int, steps: int, m: int, out: Path, clip: float, warmup: int):
    """The TrainConfig of one run of the study (see the module docstring); ``warmup`` in steps."""
    if name == "sync":  # one microbatch per step: the exact update sequence of the async runs
        return _config(opt, seed, steps * m, out, clip, schedule="1f1b", microbatches=1, warmup=warmup * m)
    if name == "sync-m":  # m microbatches per step, one update per step (2bw's reference)
        return _config(opt, seed, steps, out, clip, schedule="1f1b", microbatches=m, warmup=warmup)
    return _config(
        opt,
        seed,
        steps,
        out,
        clip,
        schedule="async-1f1b",
        microbatches=m,
        warmup=warmup,
        weight_policy=name,
        async_window=steps,
    )


def val_loss(config, out: Path) -> float:
    """Mean token cross-entropy of the final checkpoint's whole model on the fixed held-out batches."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from pipewright.data import open_dataset
    from pipewright.models.family import build_full
    from pipewright.models.gpt import loss_fn
    from pipewright.runtime.checkpointing.checkpoint import latest_checkpoint

    data = open_dataset(config.data, tokenizer=config.tokenizer, progress=False)
    spec = config.model_spec(data.vocab_size)
    flat = out / "final.pt"
    dcp_to_torch_save(latest_checkpoint(out / "checkpoints"), flat)
    state = torch.load(flat, weights_only=False)
    model = build_full(spec)
    model.load_state_dict({k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")})
    model.eval()
    losses = []
    with torch.no_grad():
        for j in range(VAL_BATCHES):
            x, y = data.batch("val", j, config.microbatch_size, spec.seq_len, VAL_SEED)
            losses.append(loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).item())
    return statistics.fmean(losses)


def run_one(name: str, opt: str, seed: int, args) -> dict:
    from pipewright.training import train

    m = args.microbatches
    out = Path(args.out) / f"{opt}-{name}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    c = run_config(name, opt, seed, args.steps, m, out, args.clip, args.warmup)
    t0 = time.perf_counter()
    result = train(c)
    wall = time.perf_counter() - t0
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    if name == "sync":  # losses per m updates, to line up with the async steps
        losses = [statistics.fmean(r["loss"] for r in records[i : i + m]) for i in range(0, len(records), m)]
    else:
        losses = [r["loss"] for r in records]
    tokens = len(records) * c.global_batch * 128
    row = {
        "name": name,
        "optimizer": opt,
        "seed": seed,
        "lr": c.lr,
        "clip": c.grad_clip,
        "steps": args.steps,
        "warmup": args.warmup,
        "microbatches": m,
        "losses": losses,
        "val_loss": val_loss(c, out),
        "wall_s": wall,
        "train_s": result.wall_s,
        "tokens_per_s": tokens / result.wall_s,
        "weight_versions": records[-1].get("weight_versions"),
    }
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


def _cache(args, name: str, opt: str, seed: int) -> Path:
    tag = f"-{args.tag}" if args.tag else ""
    return Path(args.results) / f"{opt}-{name}-s{seed}{tag}.json"


def study(args) -> None:
    Path(args.results).mkdir(parents=True, exist_ok=True)
    names = ["sync", *args.policies] + (["sync-m"] if args.throughput else [])
    for seed in args.seeds:
        for opt in args.optimizers:
            for name in names:
                path = _cache(args, name, opt, seed)
                if path.exists():
                    continue
                r = run_one(name, opt, seed, args)
                path.write_text(json.dumps(r))
                print(
                    f"{opt:6s} {name:8s} seed {seed}: train {statistics.fmean(r['losses'][-10:]):.4f} "
                    f"val {r['val_loss']:.4f}  {r['tokens_per_s']:,.0f} tok/s  {r['wall_s']:.0f} s",
                    flush=True,
                )


def speed(args) -> None:
    """Alternating rounds: sync 1F1B (m per step) then async-1f1b with each policy, same steps and
    microbatches; ratio of training-loop tokens/s (startup excluded) per round."""
    from pipewright.training import train

    root = Path(args.out) / "speed"
    rows = []
    for rnd in range(args.rounds):
        got = {}
        for name in ["sync-m", *args.policies]:
            out = root / f"r{rnd}-{name}"
            c = run_config(name, "adamw", 0, args.steps, args.microbatches, out, args.clip, 2)
            got[name] = train(c).tokens_per_s
        rows.append(got)
        print(f"round {rnd}: " + "  ".join(f"{k} {v:,.0f}" for k, v in got.items()), flush=True)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / "speed.json").write_text(json.dumps(rows))
    for name in args.policies:
        ratios = sorted(r[name] / r["sync-m"] for r in rows)
        print(
            f"async-1f1b {name} / sync 1F1B tokens/s: median {statistics.median(ratios):.2f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        )


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def names_of(runs: list[dict]) -> list[str]:
    """The run names present, in table order."""
    have = {r["name"] for r in runs}
    return [n for n in ["sync", *POLICIES, "sync-m"] if n in have]


def report(args) -> None:
    """Markdown tables (final training and validation loss per run, mean ± sd over seeds, relative to
    sync; per-seed values) and one loss-curve plot per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = f"-{args.tag}" if args.tag else ""
    runs = [json.loads(f.read_text()) for f in sorted(Path(args.results).glob(f"*-s[0-9]{tag}.json"))]
    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    tail = args.tail
    print(
        f"| optimizer | run | seeds | val loss (± sd) | vs sync | train loss, last {tail} steps (± sd) "
        "| vs sync | per-seed val loss | weight versions, ranks 0…3 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for opt in sorted({r["optimizer"] for r in runs}):
        fig, ax = plt.subplots(figsize=(7, 4))
        mine = [r for r in runs if r["optimizer"] == opt]
        ref: dict[str, float] = {}
        for name in names_of(mine):
            rs = sorted((r for r in mine if r["name"] == name), key=lambda r: r["seed"])
            if not rs:
                continue
            n = min(len(r["losses"]) for r in rs)
            val, val_sd = _mean_sd([r["val_loss"] for r in rs])
            tr, tr_sd = _mean_sd([statistics.fmean(r["losses"][-tail:]) for r in rs])
            if name == "sync":
                ref = {"val": val, "train": tr}
            rel = {k: (v / ref[k] - 1 if ref else float("nan")) for k, v in (("val", val), ("train", tr))}
            held = rs[0].get("weight_versions") or {}
            versions = " ".join(str(held[k]) for k in sorted(held, key=int)) or "1 (no async)"
            seeds = ", ".join(f"{r['val_loss']:.3f}" for r in rs)
            print(
                f"| {opt} | {name} | {len(rs)} | {val:.4f} ± {val_sd:.4f} | {rel['val']:+.1%} "
                f"| {tr:.4f} ± {tr_sd:.4f} | {rel['train']:+.1%} | {seeds} | {versions} |"
            )
            if name != "sync-m":
                mean = [statistics.fmean(r["losses"][i] for r in rs) for i in range(n)]
                ax.plot(range(1, n + 1), mean, label=f"{name} (val {val:.3f})", lw=1.2)
        rates = {
            n: statistics.fmean(r["tokens_per_s"] for r in mine if r["name"] == n) for n in names_of(mine)
        }
        if "sync-m" in rates:
            print(
                f"\n{opt} tokens/s (mean over seeds) / sync-m's: "
                + ", ".join(f"{n} {v / rates['sync-m']:.2f}" for n, v in rates.items())
                + "\n"
            )
        ax.set(
            xlabel=f"step (m = {args.microbatches} microbatches, one update each)",
            ylabel="training loss (mean over seeds)",
            title=f"async 1F1B weight policies vs sync 1F1B, p = 4, {opt}",
        )
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / f"async-{opt}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps (× m updates)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--throughput", action="store_true", help="also run sync-m (2bw's reference)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: none)")
    ap.add_argument("--tail", type=int, default=10, help="final training loss = mean of the last N steps")
    ap.add_argument("--out", default="runs/bench_async", help="training runs (checkpoints removed)")
    ap.add_argument("--results", default=str(RESULTS), help="one cached JSON per run")
    ap.add_argument("--tag", default="", help="suffix of the cached files (a variant of the study)")
    ap.add_argument("--lr", nargs=2, action="append", metavar=("OPTIMIZER", "LR"), default=[])
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--speed", action="store_true", help="alternating throughput rounds only")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    for opt, lr in args.lr:
        LR[opt] = float(lr)
    if args.speed:
        speed(args)
    elif args.report:
        report(args)
    else:
        study(args)


if __name__ == "__main__":
    main()
