"""The asynchronous pipeline's optimization, replayed in one process (a check of the runtime and of
where the loss gap comes from).

PipeDream's 1F1B without flush, with weight stashing, computes microbatch k's gradient on stage r at
version k − s_r of that stage (s_r = p − r − 1) and applies it as update k: the forward of k runs on
the *mixed* weights {stage j at version k − s_j}, the backward is consistent with it. That is a plain
sequential recurrence: for k = 0, 1, …: W_fwd = (stage j's version k − min(k, s_j)), g = ∇f(W_fwd;
batch k), W_{k+1} = step(W_k, g) with each stage's gradient clipped to its own norm, as the
asynchronous runtime does. Replaying it here (``stash``), with s = 0 (``sync``), and with the forward
on PipeOptim's prediction Ŵ_j = W_j − lr·s_j·D(W_j) taken at forward time from the state version
k − s_j holds (``predict``; the gradient is taken at Ŵ, where the runtime's backward reads the live
weights: equal when the prediction is exact), or with D of version k, which no pipeline has at that
forward (``predict-oracle``: how much of the gap is the direction's own staleness), separates the
effect of the delay itself from anything in the pipeline runtime: the replayed ``stash`` curve
should follow the runtime's ``stash`` run.

    python benchmarks/bench_async_delay.py --optimizer adamw --seed 0 --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from pipewright.data import open_dataset
from pipewright.features.async_weights.directions import predict_into
from pipewright.models.family import build_full
from pipewright.models.gpt import loss_fn
from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.runtime.setup.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
LR = {"adamw": 1e-3, "sgd": 0.05}


def stage_of(name: str, p: int) -> int:
    """Stage of a parameter in the study's layout: one layer per stage, embedding first, head last."""
    if name.startswith("embed."):
        return 0
    if name.startswith("head."):
        return p - 1
    return int(name.split(".")[1])


def replay(
    policy: str, opt: str, seed: int, steps: int, m: int = 4, p: int = 4, clip: float = 1.0
) -> list[float]:
    """Training losses per step (mean over its m updates) of the replayed recurrence."""
    c = TrainConfig(seed=seed)
    data = open_dataset(c.data, tokenizer=c.tokenizer, progress=False)
    spec = c.model_spec(data.vocab_size)
    torch.manual_seed(seed)
    model = build_full(spec, seed=seed)
    named = list(model.named_parameters())
    optimizer = build_optimizer(opt, named, lr=LR[opt], weight_decay=0.1)
    params = [q for _, q in named]
    stage = [stage_of(n, p) for n, _ in named]
    delay = [0 if policy == "sync" else p - 1 - r for r in stage]
    history: list[tuple[list[torch.Tensor], dict]] = []  # (weights, lr·D) after each update, last p
    step_d: dict[torch.Tensor, torch.Tensor] = {}  # lr·D(W) of the live state and latest gradient
    n, losses = steps * m, []
    for k in range(n):
        live = [q.detach().clone() for q in params]
        history = [*history, (live, step_d)][-p:]
        fwd = []
        for i, q in enumerate(params):
            s = min(k, delay[i])
            weights, d = history[-1 - s]  # version k − s: stage i's state when k's forward runs there
            w = weights[i]
            if policy == "predict-oracle":
                d = step_d  # the direction of version k: not yet known at that forward (an oracle)
            if s and d and policy.startswith("predict"):
                w = w - s * d[q]  # Ŵ = W_{k−s} − lr·s·D
            fwd.append(w)
        x, y = data.batch("train", k, 8, spec.seq_len, seed)
        with torch.no_grad():
            for q, w in zip(params, fwd, strict=True):
                q.copy_(w)
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for q, w in zip(params, live, strict=True):
                q.copy_(w)
        if clip > 0:
            for r in range(p):
                clip_grad_norm_([q for q, s in zip(params, stage, strict=True) if s == r], clip)
        set_lr(optimizer, lr_at(k, lr=LR[opt], warmup=10 * m, total=n, min_ratio=0.1))
        optimizer.step()
        if policy.startswith("predict"):
            grads = {q: q.grad.detach().clone() for q in params}
            step_d = {q: torch.empty_like(q) for q in params}
            predict_into(step_d, optimizer, grads, 1)
            step_d = {q: q.detach() - w for q, w in step_d.items()}
    return [statistics.fmean(losses[i : i + m]) for i in range(0, n, m)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--policies", nargs="+", default=["sync", "stash", "predict", "predict-oracle"])
    ap.add_argument("--lr", type=float, default=None, help="per-update learning rate (default: the study's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async" / "replay.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.lr is not None:
        LR[args.optimizer] = args.lr
    path = Path(args.out)
    done = json.loads(path.read_text()) if path.exists() else {}
    for policy in args.policies:
        key = f"{args.optimizer}-{policy}-s{args.seed}-lr{LR[args.optimizer]:g}-steps{args.steps}"
        done[key] = replay(policy, args.optimizer, args.seed, args.steps)
        path.write_text(json.dumps(done))
        print(f"{key}: last-10 train loss {statistics.fmean(done[key][-10:]):.4f}", flush=True)


if __name__ == "__main__":
    main()
