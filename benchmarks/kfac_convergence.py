"""K-FAC in the bubbles vs AdamW on the default small model (gpt-small-cpu, stdlib corpus, pp = 2,
1F1B): each optimizer with its learning rate tuned over a small grid, runs interleaved (AdamW, K-FAC,
AdamW, …) so both see the same machine load. Reports the loss after N steps, the steps each needs to
reach a target loss (the best AdamW run's final loss, smoothed over 5 steps) and the measured median
step time; writes a JSON summary and a loss-curve PNG.

    PYTHONPATH=src python benchmarks/kfac_convergence.py [--steps 60] [--out runs/kfac-bench]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

GRID = {"adamw": (1e-3, 3e-3, 1e-2), "kfac": (1e-3, 3e-3, 1e-2)}


def _run(opt: str, lr: float, steps: int, out: Path) -> list[dict]:
    metrics = out / "metrics.jsonl"
    if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:  # done before: reuse
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    cmd = [sys.executable, "-m", "pipewright", "train", "--optimizer", opt, "--lr", str(lr)]
    cmd += ["--steps", str(steps), "--warmup", "5", "--eval-every", "0", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1) : i + 1]) / len(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def steps_to(losses: list[float], target: float) -> int | None:
    for i, x in enumerate(smooth(losses)):
        if x <= target:
            return i + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="runs/kfac-bench")
    args = ap.parse_args()
    root = Path(args.out)
    runs: dict[tuple[str, float], list[dict]] = {}
    for lr_a, lr_k in zip(GRID["adamw"], GRID["kfac"], strict=True):
        for opt, lr in (("adamw", lr_a), ("kfac", lr_k)):
            runs[opt, lr] = _run(opt, lr, args.steps, root / f"{opt}-{lr:g}")
            print(opt, lr, round(smooth([r["loss"] for r in runs[opt, lr]])[-1], 4), flush=True)
    final = {k: smooth([r["loss"] for r in v])[-1] for k, v in runs.items()}
    best = {opt: min((k for k in final if k[0] == opt), key=final.get) for opt in GRID}
    target = final[best["adamw"]]
    summary = {"steps": args.steps, "target_loss": target, "runs": []}
    for (opt, lr), recs in runs.items():
        losses = [r["loss"] for r in recs]
        summary["runs"].append(
            {
                "optimizer": opt,
                "lr": lr,
                "final_loss_smoothed": final[opt, lr],
                "steps_to_target": steps_to(losses, target),
                "median_step_time_s": statistics.median(r["step_time_s"] for r in recs[2:]),
                "best": best[opt] == (opt, lr),
            }
        )
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (opt, lr), recs in runs.items():
        style = "-" if opt == "kfac" else "--"
        ax.plot(smooth([r["loss"] for r in recs]), style, label=f"{opt} lr={lr:g}")
    ax.axhline(target, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (5-step mean)")
    ax.set_title("gpt-small-cpu, pp=2 1F1B: K-FAC in the bubbles vs AdamW")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "loss.png", dpi=120)


if __name__ == "__main__":
    main()
