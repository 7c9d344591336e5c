"""Optimizers, learning-rate schedule and clipping (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from pipewright.errors import ConfigError
from pipewright.optim import build_optimizer, clip_grad_norm_, init_optimizer_state, lr_at


def test_lr_schedule_warmup_then_cosine():
    kw = {"lr": 1.0, "warmup": 4, "total": 14, "min_ratio": 0.1}
    assert [lr_at(k, **kw) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway: r + (1 - r)/2
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)


def test_clip_scales_to_max_norm_and_returns_the_norm():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert clip_grad_norm_([a, b], 1.0) == pytest.approx(5.0)
    assert math.hypot(*a.grad.tolist(), *b.grad.flatten().tolist()) == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_([a, b], 10.0) == pytest.approx(1.0, rel=1e-5)  # below: unchanged
    assert float(a.grad[0]) == pytest.approx(0.6, rel=1e-5)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_init_state_leaves_parameters(name):
    layer = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = build_optimizer(name, layer.named_parameters(), lr=0.1)
    init_optimizer_state(opt)
    assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), before, strict=True))
    assert all(len(opt.state[p]) > 0 for p in layer.parameters())
    assert all(g["lr"] == 0.1 for g in opt.param_groups)
    no_decay = next(g for g in opt.param_groups if g["weight_decay"] == 0.0)
    assert [p.ndim for p in no_decay["params"]] == [1]  # the bias


def test_unknown_optimizer():
    with pytest.raises(ConfigError, match="adamw"):
        build_optimizer("lamb", [], lr=0.1)


def test_gradient_norm_is_exact_for_large_and_split_tensors():
    """The global norm (squares summed in float64 over float32 blocks) is within 1e-6 of the float64
    norm for a 4-million-element gradient, the same whether the tensor is whole or split in shards,
    and stays finite (and exact) when a float32 sum of squares would overflow."""
    from pipewright.optim.stage_optimizer import _sum_of_squares

    g = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    exact = float(g.double().pow(2).sum())
    assert float(_sum_of_squares([g])) == pytest.approx(exact, rel=1e-6)
    assert float(sum(_sum_of_squares([c]) for c in g.chunk(3))) == pytest.approx(exact, rel=1e-6)
    huge = torch.full((10,), 1e20)
    assert float(_sum_of_squares([huge])) == pytest.approx(float(huge.double().pow(2).sum()), rel=1e-12)
