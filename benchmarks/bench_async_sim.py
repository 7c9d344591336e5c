"""Simulated throughput of asynchronous vs synchronous pipelines on the same model (TransformerCost).

Sync: 1F1B, m microbatches per iteration, optimizer step after the flush; W iterations with the step
barrier. Async: async-1f1b (or async-zb-h1) over one window of W·m microbatches, no flush, a STEP per
microbatch and stage. The STEP time is modelled as memory-bound: ``STEP_BYTES`` bytes per parameter
read and written (AdamW in mixed precision: fp32 weight, gradient, two moments) over the GPU's memory
bandwidth; ``predict`` adds one more elementwise pass over the weights per forward (Ŵ = W − lr·s·D:
``PREDICT_BYTES`` per parameter), charged to the STEP that precedes it; ``2bw`` steps once per m.

    python benchmarks/bench_async_sim.py            # markdown table on stdout
"""

from __future__ import annotations

from pipewright.cost.comm import Mesh
from pipewright.cost.transformer import TransformerCost
from pipewright.hardware import accelerator
from pipewright.ir import STEP
from pipewright.models.presets import resolve_model
from pipewright.schedules import build_schedule
from pipewright.sim import simulate

STEP_BYTES = 32.0  # fp32 W, grad, m, v: read 16 B, write 12 B, plus bf16 weight copy
PREDICT_BYTES = 20.0  # read W, m, v (12 B) and the gradient-free direction terms, write Ŵ


def per_microbatch(name: str, model: str, p: int, m: int, window: int, gpu: str, policy: str) -> float:
    spec = resolve_model(model)
    probe = build_schedule("1f1b", p, m)
    base = TransformerCost(spec, microbatch=1, gpu=gpu, mesh=Mesh(1, p, 1))
    params = base.parameters(probe) / p  # per stage, uniform layout
    bw = accelerator(gpu).memory_bandwidth
    step = params * STEP_BYTES / bw
    if name == "1f1b":
        cost = TransformerCost(spec, microbatch=1, gpu=gpu, mesh=Mesh(1, p, 1), extra_times={STEP: step})
        res = simulate(probe, cost, iterations=window)
        flush_step = 0.0 if any(a.kind == STEP for row in probe.actions for a in row) else step
        return (res.iteration_time + flush_step) / m  # the step after the flush, on every rank at once
    sched = build_schedule(name, p, window * m)
    if policy == "2bw":  # one update per m microbatches
        keep = {k for k in range(window * m) if k % m == m - 1}
        sched = sched.with_actions(
            [[a for a in row if a.kind != STEP or a.microbatch in keep] for row in sched.actions]
        )
    extra = step + (params * PREDICT_BYTES / bw if policy == "predict" else 0.0)
    cost = TransformerCost(spec, microbatch=1, gpu=gpu, mesh=Mesh(1, p, 1), extra_times={STEP: extra})
    return simulate(sched, cost).iteration_time / (window * m)


def main() -> None:
    window, gpu = 16, "a100-80gb"
    print("| model | p | m | sync 1F1B ms/microbatch | async-1f1b none/stash | 2bw | predict | async-zb-h1 |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ("gpt3-xl", "gpt3-2.7b"):
        for p, m in ((4, 4), (4, 8), (8, 8), (8, 16)):
            sync = per_microbatch("1f1b", model, p, m, window, gpu, "")
            cells = [
                sync / per_microbatch("async-1f1b", model, p, m, window, gpu, pol)
                for pol in ("none", "2bw", "predict")
            ]
            zb = sync / per_microbatch("async-zb-h1", model, p, m, window, gpu, "none")
            row = " | ".join(f"{c:.2f}×" for c in cells)
            print(f"| {model} | {p} | {m} | {sync * 1e3:.2f} | {row} | {zb:.2f}× |")


if __name__ == "__main__":
    main()
