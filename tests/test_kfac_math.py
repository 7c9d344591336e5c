"""K-FAC math against dense float64 references built from the definitions (PAPERS.md, PipeFisher).

Single-process cases check factors, π-damped Cholesky inverses, the preconditioned gradient (against
the Kronecker-factored Fisher (A ⊗ B) solved densely), KL-clipping, the running average, fp32 factors
under bf16, and the optimizer wrapper. The slow case forks 2 gloo processes once and checks (1) the
factors all-reduced over data-parallel replicas equal one process's factors over all the data, and
(2) column/row-parallel layers' factors equal the slices of the unsharded layer's factors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _queue_spawn import fork_launch
from pipewright.errors import ConfigError
from pipewright.features.kfac.kfac import KFAC, KFACConfig, covered_layers
from pipewright.features.kfac.optimizer import KFACOptimizer, build_base

D_IN, D_OUT, TOKENS = 5, 4, 7


def _layer(seed: int = 0, dtype=torch.float64) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D_IN, D_OUT).to(dtype)


def _record(kfac: KFAC, layer: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
    for k, (x, g) in enumerate(zip(xs, gs, strict=True)):
        kfac.microbatch = k
        y = layer(x.requires_grad_())
        y.backward(g)
    kfac.microbatch = None


def _dense_a(x: torch.Tensor) -> torch.Tensor:
    rows = [torch.cat([t, torch.ones(1, dtype=t.dtype)]) for t in x.reshape(-1, x.shape[-1])]
    return sum(torch.outer(r, r) for r in rows) / len(rows)


def _dense_b(g: torch.Tensor, s: float) -> torch.Tensor:
    rows = list(g.reshape(-1, g.shape[-1]) * s)
    return sum(torch.outer(r, r) for r in rows) / len(rows)


def _data(seed: int, mbs: int = 2):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, TOKENS, D_IN, generator=gen, dtype=torch.float64) for _ in range(mbs)]
    gs = [torch.randn(1, TOKENS, D_OUT, generator=gen, dtype=torch.float64) for _ in range(mbs)]
    return xs, gs


def test_factors_equal_dense_definition():
    layer = _layer()
    kfac = KFAC([("fc", layer)], KFACConfig(factor_decay=0.0), grad_scale=3.0)
    xs, gs = _data(1)
    _record(kfac, layer, xs, gs)
    assert sorted(kfac.pending()) == [("A", 0, 0), ("A", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    kfac.run_pending_curvature()
    kfac.reduce_factors(0)
    st = kfac.layers[0]
    want_a = sum(_dense_a(x) for x in xs) / 2
    want_b = sum(_dense_b(g, 3.0) for g in gs) / 2
    torch.testing.assert_close(st.a, want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.b, want_b, rtol=1e-12, atol=1e-12)
    assert st.a.shape == (D_IN + 1, D_IN + 1)


def test_inverses_and_preconditioned_gradient_equal_dense_kronecker_solve():
    layer = _layer()
    lam = 1e-2
    kfac = KFAC([("fc", layer)], KFACConfig(damping=lam))
    xs, gs = _data(2)
    _record(kfac, layer, xs, gs)
    kfac.refresh()
    st = kfac.layers[0]
    pi = math.sqrt((torch.trace(st.a).item() / (D_IN + 1)) / (torch.trace(st.b).item() / D_OUT))
    a_d = st.a + pi * math.sqrt(lam) * torch.eye(D_IN + 1, dtype=torch.float64)
    b_d = st.b + math.sqrt(lam) / pi * torch.eye(D_OUT, dtype=torch.float64)
    torch.testing.assert_close(st.a_inv, torch.linalg.inv(a_d), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.b_inv, torch.linalg.inv(b_d), rtol=1e-10, atol=1e-10)
    # (A ⊗ B) vec(V) = vec(∇) with column-major vec: V = B⁻¹ ∇ A⁻¹.
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    vec = torch.linalg.solve(torch.kron(a_d, b_d), grad.t().reshape(-1))
    want = vec.reshape(D_IN + 1, D_OUT).t()
    kfac.precondition(0)
    torch.testing.assert_close(st.preconditioned, want, rtol=1e-9, atol=1e-10)


def test_kl_clip_and_apply_write_scaled_update_into_grads():
    layer = _layer()
    kfac = KFAC([("fc", layer)], KFACConfig(kl_clip=1e-4))
    xs, gs = _data(3)
    _record(kfac, layer, xs, gs)
    kfac.refresh()
    kfac.precondition(0)
    v = kfac.layers[0].preconditioned.clone()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1).clone()
    lr = 0.5
    vg = float((v * grad).sum()) * lr * lr
    want_nu = min(1.0, math.sqrt(1e-4 / vg))
    nu = kfac.apply(lr)
    assert nu == pytest.approx(want_nu, rel=1e-12) and nu < 1
    torch.testing.assert_close(layer.weight.grad, v[:, :D_IN] * want_nu)
    torch.testing.assert_close(layer.bias.grad, v[:, D_IN] * want_nu)


def test_running_average_over_refreshes():
    layer = _layer()
    rho = 0.75
    kfac = KFAC([("fc", layer)], KFACConfig(factor_decay=rho))
    (x1, x2), (g1, g2) = _data(4)
    _record(kfac, layer, [x1], [g1])
    kfac.refresh()
    _record(kfac, layer, [x2], [g2])
    kfac.refresh()
    torch.testing.assert_close(kfac.layers[0].a, rho * _dense_a(x1) + (1 - rho) * _dense_a(x2))
    torch.testing.assert_close(kfac.layers[0].b, rho * _dense_b(g1, 1) + (1 - rho) * _dense_b(g2, 1))


def test_factors_stay_fp32_under_bf16():
    layer = _layer(dtype=torch.bfloat16)
    kfac = KFAC([("fc", layer)])
    x = torch.randn(2, TOKENS, D_IN).bfloat16()
    kfac.microbatch = 0
    layer(x).sum().backward()
    kfac.refresh()
    st = kfac.layers[0]
    assert st.a.dtype == st.b.dtype == st.a_inv.dtype == st.b_inv.dtype == torch.float32
    torch.testing.assert_close(st.a, _dense_a(x.double()).float(), rtol=1e-5, atol=1e-5)
    kfac.precondition(0)
    kfac.apply(0.1)
    assert layer.weight.grad.dtype == torch.bfloat16


def test_config_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="multiple of the factor interval"):
        KFACConfig(factor_interval=3, inv_interval=10)
    with pytest.raises(ConfigError, match="damping must be positive"):
        KFACConfig(damping=0)


@pytest.mark.parametrize("base", ["sgd", "adamw", "lamb"])
def test_optimizer_preconditions_covered_layers_and_leaves_others_first_order(base):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 6), nn.LayerNorm(6), nn.Linear(6, D_OUT)).double()
    layers = covered_layers(model)
    assert [n for n, _ in layers] == ["0", "2"]
    kfac = KFAC(layers, KFACConfig(kl_clip=0.0, inv_interval=1))
    opt = KFACOptimizer(kfac, build_base(base, model.named_parameters(), lr=0.1, weight_decay=0.0))
    x = torch.randn(3, TOKENS, D_IN, dtype=torch.float64)
    kfac.microbatch = 0
    model(x).pow(2).mean().backward()
    kfac.microbatch = None
    ln_grad = model[1].weight.grad.clone()
    # the reference: the same refresh and preconditioning done by hand on copies of the gradients
    ref = KFAC(layers, KFACConfig(kl_clip=0.0))
    ref.layers[0].saved_inputs = dict(kfac.layers[0].saved_inputs)
    ref.layers[0].saved_grads = dict(kfac.layers[0].saved_grads)
    ref.run_pending_curvature()
    ref.reduce_factors(0)
    ref.invert(0, "A")
    ref.invert(0, "B")
    ref.precondition(0)
    want_v0 = ref.layers[0].preconditioned.clone()
    ref.remove_hooks()
    before = [p.detach().clone() for p in model.parameters()]
    if base == "sgd":
        opt.step()
        # first SGD step with momentum: Δw = −lr · grad
        torch.testing.assert_close(model[0].weight - before[0], -0.1 * want_v0[:, :D_IN])
        torch.testing.assert_close(model[0].bias - before[1], -0.1 * want_v0[:, D_IN])
        torch.testing.assert_close(model[1].weight - before[2], -0.1 * ln_grad)
    else:
        opt.step()
        torch.testing.assert_close(model[0].weight.grad, want_v0[:, :D_IN])
        torch.testing.assert_close(model[1].weight.grad, ln_grad)  # first-order path untouched
    assert opt.steps == 1


# ----------------------------------------------------------------------------- gloo, 2 processes


def _worker(rank: int) -> list[str]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    return _dp_case(rank, world) + _tp_case(rank, world)


def _close(label: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    err = (got.double() - want.double()).abs().max().item()
    return [] if err <= 1e-10 * max(1.0, want.abs().max().item()) else [f"{label}: error {err:.3g}"]


def _dp_case(rank: int, world: int) -> list[str]:
    """Each replica sees its own microbatches; reduced factors = one process over all of them."""
    xs, gs = _data(10, mbs=2 * world)
    layer = _layer()
    kfac = KFAC([("fc", layer)], KFACConfig(factor_decay=0.0), dp_group=dist.group.WORLD)
    _record(kfac, layer, xs[2 * rank : 2 * rank + 2], gs[2 * rank : 2 * rank + 2])
    kfac.run_pending_curvature()
    kfac.reduce_factors(0)
    solo_layer = _layer()
    solo = KFAC([("fc", solo_layer)], KFACConfig(factor_decay=0.0))
    _record(solo, solo_layer, xs, gs)
    solo.run_pending_curvature()
    solo.reduce_factors(0)
    return _close("dp A", kfac.layers[0].a, solo.layers[0].a) + _close(
        "dp B", kfac.layers[0].b, solo.layers[0].b
    )


def _tp_case(rank: int, world: int) -> list[str]:
    """Column-parallel (fused 3-block output like QKV) and row-parallel linears vs the full layer."""
    from pipewright.runtime.parallel import tp

    group = dist.group.WORLD
    d_in, d_out, blocks = 4, 2 * 3 * world, 3
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, d_in, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, d_out, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    full = nn.Linear(d_in, d_out).double()
    with torch.no_grad():
        full.weight.copy_(w)
    ref = KFAC([("full", full)])
    _record(ref, full, [x.clone()], [g.clone()])
    ref.run_pending_curvature()
    ref.reduce_factors(0)
    col = tp.ColumnParallelLinear(d_in, d_out, group, blocks=blocks, dtype=torch.float64)
    col.load_full_(w, torch.zeros(d_out, dtype=torch.float64))
    kc = KFAC([("col", col)])
    n = d_out // (world * blocks)
    rows = [b * (d_out // blocks) + rank * n + j for b in range(blocks) for j in range(n)]
    kc.microbatch = 0
    col(x.clone().requires_grad_()).backward(g[..., rows])
    kc.run_pending_curvature()
    kc.reduce_factors(0)
    msgs = _close("column A", kc.layers[0].a, ref.layers[0].a)
    msgs += _close("column B", kc.layers[0].b, ref.layers[0].b[rows][:, rows])
    # row-parallel: input columns split, output gradient full; A = diagonal block without ones column
    d_in2, d_out2 = 2 * world, 3
    x2 = torch.randn(2, 3, d_in2, generator=gen, dtype=torch.float64)
    g2 = torch.randn(2, 3, d_out2, generator=gen, dtype=torch.float64)
    w2 = torch.randn(d_out2, d_in2, generator=gen, dtype=torch.float64)
    full2 = nn.Linear(d_in2, d_out2).double()
    with torch.no_grad():
        full2.weight.copy_(w2)
    ref2 = KFAC([("full", full2)])
    _record(ref2, full2, [x2.clone()], [g2.clone()])
    ref2.run_pending_curvature()
    ref2.reduce_factors(0)
    row = tp.RowParallelLinear(d_in2, d_out2, group, dtype=torch.float64)
    row.load_full_(w2, torch.zeros(d_out2, dtype=torch.float64))
    kr = KFAC([("row", row)])
    cols = list(range(rank * 2, rank * 2 + 2))
    kr.microbatch = 0
    row(x2[..., cols].clone().requires_grad_()).backward(g2)
    kr.run_pending_curvature()
    kr.reduce_factors(0)
    msgs += _close("row A", kr.layers[0].a, ref2.layers[0].a[cols][:, cols])
    msgs += _close("row B", kr.layers[0].b, ref2.layers[0].b)
    return msgs


@pytest.mark.slow
def test_dp_factors_equal_single_process_and_tp_factors_equal_slices():
    results = fork_launch(_worker, 2, timeout_s=120)
    assert results == [[], []]


@pytest.mark.parametrize(("panels", "blocks"), [(1, 0), (3, 0), (4, 2), (5, 3)])
def test_piecewise_inverse_equals_dense_inverse(panels, blocks):
    from pipewright.features.kfac.factors import PiecewiseInverse

    gen = torch.Generator().manual_seed(panels)
    x = torch.randn(20, 11, generator=gen, dtype=torch.float64)
    m = x.t() @ x / 20
    inv = PiecewiseInverse(m, 0.1, panels, blocks)
    steps = 0
    while not inv.done:
        assert inv.result is None
        inv.step()
        steps += 1
    assert steps == panels + max(blocks, 1)
    want = torch.linalg.inv(m + 0.1 * torch.eye(11, dtype=torch.float64))
    torch.testing.assert_close(inv.result, want, rtol=1e-10, atol=1e-10)


def test_factor_and_inverse_intervals():
    """factor_interval 1, inv_interval 2: factors every step, inverses at steps 0, 2, 4."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D_IN, D_OUT)).double()
    kfac = KFAC(covered_layers(model), KFACConfig(factor_interval=1, inv_interval=2, kl_clip=0.0))
    opt = KFACOptimizer(kfac, build_base("sgd", model.named_parameters(), lr=0.01, weight_decay=0.0))
    seen_a, seen_inv = [], []
    for _ in range(4):
        kfac.microbatch = 0 if opt.record() else None
        model(torch.randn(2, TOKENS, D_IN, dtype=torch.float64)).pow(2).mean().backward()
        kfac.microbatch = None
        opt.step()
        opt.zero_grad()
        seen_a.append(kfac.layers[0].a.clone())
        seen_inv.append(kfac.layers[0].a_inv.clone())
    assert all(not torch.equal(seen_a[i], seen_a[i + 1]) for i in range(3))  # factors every step
    assert torch.equal(seen_inv[0], seen_inv[1]) and torch.equal(seen_inv[2], seen_inv[3])
    assert not torch.equal(seen_inv[1], seen_inv[2])  # inverted again at step 2
