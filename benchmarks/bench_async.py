"""Convergence and throughput of asynchronous 1F1B weight policies against synchronous 1F1B (CPU).

Every run trains the default small model (``gpt-small-cpu``) on the default corpus at p = 4 with the
same microbatches in the same order: N = steps × m microbatches of b sequences, one optimizer update
per microbatch (``2bw``: per m). The synchronous reference is 1F1B with one microbatch per step and
steps × m steps (the update sequence the asynchronous runs approximate); its throughput is also
measured with m microbatches per step (the usual synchronous configuration). Results go to
``--out/results.json``; ``--report`` draws docs/img/async-*.png and prints the markdown tables.

    python benchmarks/bench_async.py --steps 100 --seeds 0 1 2          # ~40 min on 2 shared cores
    python benchmarks/bench_async.py --report --out runs/bench_async
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("none", "stash", "2bw", "predict", "dc")
LR = {"adamw": 1e-3, "sgd": 0.05}  # per-update (one microbatch) learning rates; --lr overrides


def _config(opt: str, seed: int, steps: int, m: int, out: Path, **kw):
    from pipewright.runtime.config import TrainConfig

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
        grad_clip=1.0,
        out=str(out),
    )
    base.update(kw)
    return TrainConfig(**base)


def run_one(name: str, opt: str, seed: int, steps: int, m: int, root: Path) -> dict:
    from pipewright.runtime.trainer import train

    out = root / f"{opt}-{name}-s{seed}"
    if name == "sync":  # one microbatch per step: the exact update sequence of the async runs
        c = _config(opt, seed, steps * m, m, out, schedule="1f1b", microbatches=1, warmup=20 * m)
    elif name == "sync-m":  # throughput reference: m microbatches per step, one update per step
        c = _config(opt, seed, steps, m, out, schedule="1f1b", microbatches=m, warmup=20)
    else:
        c = _config(
            opt,
            seed,
            steps,
            m,
            out,
            schedule="async-1f1b",
            microbatches=m,
            warmup=20,
            weight_policy=name,
            async_window=min(25, steps),
        )
    t0 = time.perf_counter()
    result = train(c)
    wall = time.perf_counter() - t0
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    if name == "sync":  # losses per m updates, to line up with the async steps
        losses = [statistics.fmean(r["loss"] for r in records[i : i + m]) for i in range(0, len(records), m)]
    else:
        losses = [r["loss"] for r in records]
    tokens = sum(1 for _ in records) * c.global_batch * 128
    return {
        "name": name,
        "optimizer": opt,
        "seed": seed,
        "losses": losses,
        "wall_s": wall,
        "train_s": result.wall_s,
        "tokens_per_s": tokens / result.wall_s,
        "weight_versions": records[-1].get("weight_versions"),
        "config": asdict(c),
    }


def study(args) -> None:
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "results.json"
    done = json.loads(path.read_text()) if path.exists() else []
    have = {(r["name"], r["optimizer"], r["seed"]) for r in done}
    names = ["sync", *args.policies] + (["sync-m"] if args.throughput else [])
    for seed in args.seeds:
        for opt in args.optimizers:
            for name in names:
                if (name, opt, seed) in have:
                    continue
                r = run_one(name, opt, seed, args.steps, args.microbatches, root)
                done.append(r)
                path.write_text(json.dumps(done))
                print(
                    f"{opt:6s} {name:8s} seed {seed}: final {r['losses'][-1]:.4f}  "
                    f"{r['tokens_per_s']:,.0f} tok/s  {r['wall_s']:.0f} s",
                    flush=True,
                )


def speed(args) -> None:
    """Alternating rounds: sync 1F1B (m per step) then async-1f1b with each policy, same steps and
    microbatches; ratio of training-loop tokens/s (startup excluded) per round."""
    from pipewright.runtime.trainer import train

    root = Path(args.out) / "speed"
    rows = []
    for rnd in range(args.rounds):
        got = {}
        for name in ["sync-m", *args.policies]:
            out = root / f"r{rnd}-{name}"
            if name == "sync-m":
                c = _config(
                    "adamw",
                    0,
                    args.steps,
                    args.microbatches,
                    out,
                    schedule="1f1b",
                    microbatches=args.microbatches,
                    warmup=2,
                )
            else:
                c = _config(
                    "adamw",
                    0,
                    args.steps,
                    args.microbatches,
                    out,
                    schedule="async-1f1b",
                    microbatches=args.microbatches,
                    warmup=2,
                    weight_policy=name,
                    async_window=args.steps,
                )
            got[name] = train(c).tokens_per_s
        rows.append(got)
        print(f"round {rnd}: " + "  ".join(f"{k} {v:,.0f}" for k, v in got.items()), flush=True)
    (root / "speed.json").write_text(json.dumps(rows))
    for name in args.policies:
        ratios = sorted(r[name] / r["sync-m"] for r in rows)
        print(
            f"async-1f1b {name} / sync 1F1B tokens/s: median {statistics.median(ratios):.2f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        )


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads((Path(args.out) / "results.json").read_text())
    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    tail = args.tail
    print(
        f"| optimizer | run | seeds | final loss (mean of last {tail} steps, ± sd over seeds) | vs sync "
        "| tokens/s (shared CPU) | weight versions, ranks 0…3 |"
    )
    print("|---|---|---|---|---|---|---|")
    for opt in sorted({r["optimizer"] for r in runs}):
        fig, ax = plt.subplots(figsize=(7, 4))
        mine = [r for r in runs if r["optimizer"] == opt]
        finals = {}
        for name in ["sync", *POLICIES, "sync-m"]:
            rs = [r for r in mine if r["name"] == name]
            if not rs:
                continue
            n = min(len(r["losses"]) for r in rs)
            mean = [statistics.fmean(r["losses"][i] for r in rs) for i in range(n)]
            per_seed = [statistics.fmean(r["losses"][-tail:]) for r in rs]
            finals[name] = statistics.fmean(per_seed)
            sd = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
            tps = statistics.fmean(r["tokens_per_s"] for r in rs)
            rel = finals[name] / finals["sync"] - 1 if "sync" in finals else float("nan")
            held = rs[0].get("weight_versions") or {}
            versions = " ".join(str(held[k]) for k in sorted(held, key=int)) or "1 (no async)"
            print(
                f"| {opt} | {name} | {len(rs)} | {finals[name]:.4f} ± {sd:.4f} | {rel:+.1%} | {tps:,.0f} "
                f"| {versions} |"
            )
            if name != "sync-m":
                ax.plot(range(1, n + 1), mean, label=name, lw=1.2)
        ax.set(
            xlabel=f"step (m = {args.microbatches} microbatches)",
            ylabel="training loss",
            title=f"async 1F1B weight policies, p = 4, {opt}",
        )
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / f"async-{opt}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"])
    ap.add_argument("--policies", nargs="+", default=["predict", "none", "stash", "2bw", "dc"])
    ap.add_argument(
        "--throughput", action="store_true", help="also run sync 1F1B with m microbatches per step"
    )
    ap.add_argument("--tail", type=int, default=10, help="final loss = mean over the last N steps")
    ap.add_argument("--out", default="runs/bench_async")
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
