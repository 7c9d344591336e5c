"""Step time of a small mixture-of-experts model on CPU: expert parallelism (ep = 2, all-to-all over
gloo) against the same model with every expert on every data-parallel rank (ep = 1), and the dense
model of the same shape, at pp = 2 × dp = 2 (four processes, one thread each).

The model: GPT, 4 layers, hidden 64, 4 heads, sequence 64, 8 experts of 256 (top-2) in every layer
(the dense model: one MLP of 256); microbatch 4, 4 microbatches per replica, 1F1B. Each configuration
runs ``--steps`` steps per round, rounds alternate between the configurations, and the median step
time after the first two steps of every round is reported, with the ratio to ep = 1.

    python benchmarks/bench_moe.py --rounds 2 --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

CONFIGS = {
    "dense": {"model": "gpt", "moe_experts": 0},
    "moe ep=1": {"model": "gpt", "moe_experts": 8, "ep": 1},
    "moe ep=2": {"model": "gpt", "moe_experts": 8, "ep": 2},
}


def _run(name: str, steps: int, schedule: str, out: Path) -> list[float]:
    from pipewright.runtime.setup.config import TrainConfig
    from pipewright.training import train

    config = TrainConfig(
        layers=4, hidden=64, heads=4, vocab=256, seq_len=64, ffn_hidden=256, pp=2, dp=2,
        microbatches=4, microbatch_size=4, steps=steps, warmup=0, schedule=schedule, progress=False,
        artifacts=False, eval_every=0, out=str(out), **CONFIGS[name],
    )  # fmt: skip
    train(config)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step_time_s"] for line in lines][2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in CONFIGS:
                times[name] += _run(
                    name, args.steps, args.schedule, Path(tmp) / f"{name}-{r}".replace(" ", "_")
                )
    base = statistics.median(times["moe ep=1"])
    print("| configuration | median step time (s) | ratio to moe ep=1 |\n|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.4f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
