"""K-FAC with mixed precision, in checkpoints, and with each base update (``--kfac-base``).

One launch of 2 forked gloo processes (pp = 2, 1F1B, a tiny model) builds several trainers on one mesh. Every
trainer fills its bubbles with all pending K-FAC tasks (``--kfac-fill all``), so when a refresh's
tasks run depends only on the schedule, not on measured times, and runs are reproducible:

- bf16 K-FAC gives fp32 K-FAC's losses within bf16's precision, with fp32 factors and inverses and
  preconditioning on the fp32 master gradients;
- fp16: a step the loss scaler skips (an overflow forced by a huge scale) contributes no factors: the
  refresh records the next iteration instead, and its factors equal those of a run that never saw the
  overflowed step;
- a run resumed from a checkpoint saved mid-refresh gives the uninterrupted run's losses exactly;
  resuming onto pp = 1 × dp = 2 keeps the factors and inverses; onto tp = 2 is a one-line error;
- ``--kfac-base sgd|adamw|lamb``: the step equals the API's ``build_base`` update of the same
  preconditioned gradient.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _kfac_config import tiny_config
from _queue_spawn import fork_launch
from pipewright.errors import ConfigError
from pipewright.features.kfac.kfac import KFAC, KFACConfig
from pipewright.features.kfac.optimizer import Lamb, build_base
from pipewright.features.kfac.runtime import BubbleWorker, PipelinedKFAC
from pipewright.features.kfac.state import StateNames, load_state, save_state
from pipewright.optim import set_lr
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.training import check_config, config_from_toml, prepare, replaced

STEPS = 6


def _trainer(run, mesh, *, interval: int = 10) -> Trainer:
    tr = Trainer(run, mesh=mesh)
    assert tr.optimizer.worker.fill_scale == math.inf  # --kfac-fill all: reproducible
    tr.optimizer.worker.min_interval = interval
    return tr


def _steps(tr: Trainer, steps) -> list[float]:
    out = []
    for step in steps:
        out.append(tr.forward_backward(step))
        tr.optimizer_step(step)
    return out


def _factors(tr: Trainer) -> dict[str, tuple]:
    return {st.name: (st.a, st.b, st.a_inv, st.b_inv) for st in tr.optimizer.kfac.layers}


def _factor_sums(opt: PipelinedKFAC) -> dict[str, float]:
    """Σ A per layer, by the layer's checkpoint name (layout-free)."""
    return {n: float(st.a.sum()) for n, st in zip(opt.names.layers, opt.kfac.layers, strict=True)}


def _precision(runs, mesh) -> dict:
    fp32, bf16 = (_trainer(runs[name], mesh) for name in ("fp32", "bf16"))
    out = {"fp32": _steps(fp32, range(5)), "bf16": _steps(bf16, range(5))}
    out["bf16_dtypes"] = sorted({str(t.dtype) for f in _factors(bf16).values() for t in f if t is not None})
    out["bf16_refreshes"] = bf16.optimizer.worker.refreshes
    out["model_dtype"] = str(bf16.optimizer.kfac.layers[0].module.weight.dtype)
    # fp16: step 0 overflows (a huge loss scale), so the refresh records iteration 1 instead
    skipped, clean = (_trainer(runs["fp16"], mesh) for _ in range(2))
    skipped.options.scaler.scale = 2.0**100
    loss0 = skipped.forward_backward(0)
    skipped.optimizer_step(0)
    out["fp16_skipped"] = skipped.options.scaler.skipped
    skipped.options.scaler.scale = clean.options.scaler.scale = 2.0**10
    out["fp16_after_skip"] = [loss0, *_steps(skipped, [1, 2])]
    out["fp16_clean"] = _steps(clean, [1, 2])  # never saw step 0: records batch 1 at the same weights
    a, b = _factors(skipped), _factors(clean)
    out["fp16_equal"] = all(
        x is not None and torch.equal(x, y) for k in a for x, y in zip(a[k], b[k], strict=True)
    )
    out["fp16_finite"] = all(bool(torch.isfinite(x).all()) for f in a.values() for x in f if x is not None)
    return out


def _checkpoint(runs, mesh) -> dict:
    run = runs["ckpt"]
    whole = _trainer(run, mesh, interval=2)  # a refresh every 2 iterations: the save is mid-refresh
    out = {"whole": _steps(whole, range(STEPS))}
    first = _trainer(run, mesh, interval=2)
    part = _steps(first, range(STEPS // 2))
    kfac = first.optimizer.kfac
    out["pending_at_save"] = bool(kfac.pending()) or any(st.a_sum is not None for st in kfac.layers)
    path = first.save(STEPS // 2)
    saved = _factor_sums(first.optimizer)
    second = _trainer(run, mesh, interval=2)
    start = second.load(path)
    out["resumed"] = part + _steps(second, range(start, STEPS))
    # onto another layout: pp = 1 × dp = 2 keeps the factors and inverses
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, saved)
    want = {k: v for d in gathered for k, v in d.items()}
    flat = ParallelMesh.build(dp=2, pp=1, tp=1)
    moved = _trainer(runs["dp2"], flat)
    moved.load(path)
    kfac = moved.optimizer
    out["resharded"] = _factor_sums(kfac) == want
    out["resharded_inverses"] = all(st.a_inv is not None for st in kfac.kfac.layers)
    out["resharded_loss"] = _steps(moved, [STEPS // 2])
    wide = Trainer(runs["tp2"], mesh=ParallelMesh.build(dp=1, pp=1, tp=2))
    try:
        wide.load(path)
        out["tp_error"] = None
    except ConfigError as exc:
        out["tp_error"] = str(exc)
    return out


def _bases(runs, mesh) -> dict:
    out = {}
    for name in ("sgd", "adamw", "lamb"):
        tr = _trainer(runs[name], mesh)
        _steps(tr, [0])
        tr.forward_backward(1)
        opt = tr.optimizer
        before = {n: p.detach().clone() for n, p in tr.params.items()}
        state = copy.deepcopy(opt.base.state_dict())
        lr, _ = tr.optimizer_step(1)
        ref_params = {n: nn.Parameter(before[n].clone()) for n in tr.params}
        for n, p in tr.params.items():
            ref_params[n].grad = p.grad.clone()  # the KL-clipped preconditioned gradient the base got
        ref = build_base(name, ref_params.items(), tr.config.lr, tr.config.weight_decay)
        ref.load_state_dict(state)
        set_lr(ref, lr)
        ref.step()
        out[name] = {
            "type": type(opt.base).__name__,
            "equal": all(torch.equal(ref_params[n], p) for n, p in tr.params.items()),
            "preconditioned": all(st.a_inv is not None for st in opt.kfac.layers),
        }
    return out


def _worker(rank: int, runs) -> dict:
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, pp=2, tp=1)
    out = _precision(runs, mesh)
    out.update(_bases(runs, mesh))
    out.update(_checkpoint(runs, mesh))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tiny_config(tmp_path_factory, STEPS, optimizer="kfac", kfac_fill="all")
    out = str(tmp_path_factory.mktemp("ckpt"))
    configs = {
        "fp32": base,
        "bf16": replace(base, precision="bf16"),
        "fp16": replace(base, precision="fp16"),
        "ckpt": replace(base, out=out),
        "dp2": replace(base, out=out, pp=1, dp=2),
        "tp2": replace(base, out=out, pp=1, tp=2),
        **{name: replaced(base, kfac_base=name) for name in ("sgd", "adamw", "lamb")},
    }
    runs = {name: prepare(c, world_size=2) for name, c in configs.items()}
    return fork_launch(_worker, 2, (runs,), timeout_s=600)


@pytest.mark.slow
def test_bf16_kfac_matches_fp32_with_fp32_factors(results):
    last = results[1]  # the loss is known on the last stage's rank
    assert last["bf16_refreshes"] >= 1 and last["model_dtype"] == "torch.bfloat16"
    assert last["bf16_dtypes"] == ["torch.float32"]
    np.testing.assert_allclose(last["bf16"], last["fp32"], rtol=0.01)  # measured: ≤ 0.3 %
    assert last["bf16"][-1] < last["bf16"][0]


@pytest.mark.slow
def test_fp16_overflow_step_contributes_no_factors(results):
    for r in results:
        assert r["fp16_skipped"] == 1 and r["fp16_finite"] and r["fp16_equal"]
    assert results[1]["fp16_after_skip"][1:] == results[1]["fp16_clean"]


@pytest.mark.slow
def test_resume_mid_refresh_gives_the_same_losses(results):
    last = results[1]
    assert last["pending_at_save"]
    assert last["resumed"] == last["whole"]  # exactly


@pytest.mark.slow
def test_resume_onto_another_layout(results):
    for r in results:
        assert r["resharded"] and r["resharded_inverses"]
        assert r["tp_error"].endswith("resume K-FAC with --tp 1") and "\n" not in r["tp_error"]
    assert math.isfinite(results[0]["resharded_loss"][0])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kind"), [("sgd", "SGD"), ("adamw", "AdamW"), ("lamb", "Lamb")])
def test_kfac_base_update_equals_the_api(results, name, kind):
    for r in results:
        assert r[name] == {"type": kind, "equal": True, "preconditioned": True}


def test_worker_state_round_trip_mid_inversion():
    """A refresh part-way through its inversions (dp = 2: finished inverses staged, not installed)
    saved and restored into a new worker continues to the same inverses as the original."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 300), nn.GELU(), nn.Linear(300, 5))

    def worker() -> PipelinedKFAC:
        kfac = KFAC([("0", model[0]), ("2", model[2])], KFACConfig())
        w = BubbleWorker(kfac, [0, 0], microbatches=2, dp=2)
        base = build_base("adamw", model.named_parameters(), 1e-3, 0.0)
        return PipelinedKFAC(kfac, base, w, StateNames("l", "r0", ("0", "2")))

    a = worker()
    a.worker.begin_iteration(0)
    for k in range(2):
        a.kfac.microbatch = k
        model(torch.randn(2, 3, 6)).pow(2).sum().backward()
    a.kfac.microbatch = None
    a.worker.stepped()
    a.worker.begin_iteration(1)
    a.kfac.run_pending_curvature()
    for i in range(2):
        a.worker._reduce(i)
    for _ in range(3):  # part of the inversions: some staged, some mid-Cholesky
        a.worker.run_one(None)
    assert a.worker.staged and a.worker.jobs
    b = worker()
    load_state(b, b.names, {k: v.clone() for k, v in save_state(a, a.names).items()})
    for w in (a.worker, b.worker):
        w.drain()
        w.dp = 1
        w._install()
    assert a.worker.refreshes == b.worker.refreshes == 1
    for x, y in zip(a.kfac.layers, b.kfac.layers, strict=True):
        assert torch.equal(x.a_inv, y.a_inv) and torch.equal(x.b_inv, y.b_inv)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizer", "kfac", "--kfac-base", "rmsprop"], "--kfac-base must be one of sgd, adamw, lamb"),
        (["--kfac-base", "sgd"], "--kfac-base sgd needs --optimizer kfac"),
        (["--optimizer", "kfac", "--kfac-fill", "some"], "--kfac-fill must be one of measured, all"),
        (["--kfac-fill", "all"], "--kfac-fill all needs --optimizer kfac"),
        (["--optimizer", "kfac", "--shard-optimizer"], "does not combine with --shard-optimizer"),
    ],
)
def test_kfac_flags_one_line_errors(flags, message):
    import argparse

    from pipewright.cli.train import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["train", *flags]))
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_kfac_base_from_toml(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[train]\noptimizer = "kfac"\nkfac-base = "lamb"\n')
    config = check_config(config_from_toml(path))
    assert config.features["kfac"].base == "lamb"
    assert isinstance(
        build_base(config.features["kfac"].base, nn.Linear(2, 2).named_parameters(), 1e-3, 0.0), Lamb
    )
