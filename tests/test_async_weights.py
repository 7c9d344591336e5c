"""Asynchronous pipelines: optimizer directions and prediction, version differences read
from the schedule, the weight policies' forward/backward weights, and the reduction to synchronous
training with one stage. Single-process except the two slow trainer checks at the end."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _queue_spawn import fork_launch
from pipewright.errors import ConfigError
from pipewright.features.async_weights.directions import BUILTIN, directions, predict_into
from pipewright.features.async_weights.policies import POLICIES, make_policy, policy_optimizer
from pipewright.features.async_weights.runtime import AsyncRuntime, AsyncStage
from pipewright.features.async_weights.staleness import staleness, steady_staleness, versions_in_flight
from pipewright.ir import STEP, Action, B, F
from pipewright.schedules import build_schedule

torch.set_num_threads(1)


def _param(seed: int = 0, shape=(4, 3)) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=g))


def _steps(opt: torch.optim.Optimizer, p: nn.Parameter, g: torch.Tensor, n: int) -> None:
    for _ in range(n):
        p.grad = g.clone()
        opt.step()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.25),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, weight_decay=0.01),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_direction_is_the_optimizers_next_step(name):
    """W − lr·D(W) equals what optimizer.step() makes of the latest gradient, from a warm state."""
    p = _param()
    opt = OPTIMIZERS[name]([p])
    _steps(opt, p, torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), 3)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    ((_, d, lr),) = directions(opt, {p: g})
    want = p.detach() - lr * d
    _steps(opt, p, g, 1)
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_plain_sgd_prediction_is_exact():
    """Plain SGD: s steps along g give exactly W − lr·s·g (values exact in binary)."""
    p = nn.Parameter(torch.tensor([[1.5, -2.0], [0.25, 8.0]]))
    g = torch.tensor([[0.5, 1.0], [-0.25, 2.0]])
    opt = torch.optim.SGD([p], lr=0.25)
    _steps(opt, p, g, 1)
    out = {p: torch.empty_like(p)}
    for s in range(5):
        predict_into(out, opt, {p: g}, s)
        q = copy.deepcopy(p)
        o2 = torch.optim.SGD([q], lr=0.25)
        _steps(o2, q, g, s)
        assert torch.equal(out[p], q.detach()), s


@pytest.mark.parametrize("name", ["adam", "adamw", "rmsprop", "sgd-momentum", "sgd-nesterov"])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_prediction_matches_s_steps_along_the_same_direction(name, s):
    """Once the state is steady for a constant gradient (built with lr = 0, so W does not move), each
    step moves along the same direction and s steps land on Ŵ = W − lr·s·D to tolerance (AdamW's and
    SGD's decay terms drift with W: second order in lr)."""
    p = _param(3)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    opt = OPTIMIZERS[name]([p])
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.0
    _steps(opt, p, g, 1500)
    opt.param_groups[0]["lr"] = lr
    start = p.detach().clone()
    out = {p: torch.empty_like(p)}
    predict_into(out, opt, {p: g}, s)
    _steps(opt, p, g, s)
    moved = (p.detach() - start).abs().max()
    assert moved > 0
    err = (out[p] - p.detach()).abs().max()
    tol = 5e-3 if name == "sgd-momentum" else 1e-3  # its L2 term λW drifts with W (lr·λ·s² order)
    assert err <= tol * moved, (name, s, float(err), float(moved))


def test_adamw_prediction_needs_the_decoupled_decay():
    """Leaving λ·W out of D (as the reference code does) misses AdamW's trajectory by far more."""
    p = nn.Parameter(torch.full((8,), 4.0))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    g = torch.full((8,), 1e-3)
    _steps(opt, p, g, 1)
    out = {p: torch.empty_like(p)}
    predict_into(out, opt, {p: g}, 3)
    state = opt.state[p]
    group = {**opt.param_groups[0], "weight_decay": 0.0}
    no_decay = p.detach() - 1e-3 * 3 * BUILTIN[torch.optim.Adam](p.detach(), g, state, group)
    _steps(opt, p, g, 3)
    good = (out[p] - p.detach()).abs().max()
    bad = (no_decay - p.detach()).abs().max()
    assert good < 1e-5 and bad > 100 * good


def test_new_optimizer_plugs_in_by_its_own_direction():
    class Halving(torch.optim.SGD):
        def update_direction(self, param, grad):
            return param.detach() * 0.5

    p = nn.Parameter(torch.tensor([2.0, 4.0]))
    opt = Halving([p], lr=0.5)
    out = {p: torch.empty_like(p)}
    predict_into(out, opt, {}, 2)
    assert out[p].tolist() == [1.0, 2.0]
    with pytest.raises(ConfigError, match="update_direction"):
        directions(type("Other", (torch.optim.SGD,), {})([p], lr=0.1), {})


# -- version differences from the schedule ------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("mult", [1, 3])
def test_staleness_of_pipedream_1f1b_is_p_minus_r_minus_1(p, mult):
    m = mult * p
    sched = build_schedule("async-1f1b", p, m)
    assert steady_staleness(sched) == {r: p - r - 1 for r in range(p)}
    for r in range(p):
        # the window's first microbatches meet fewer updates: k of them before microbatch k's backward
        assert [staleness(sched, r, k) for k in range(m)] == [min(k, p - r - 1) for k in range(m)]
    held = versions_in_flight(sched)  # live + stashed; p − r once the window is past its start
    assert all(held[r] <= p - r for r in range(p))
    if mult > 1:
        assert held == {r: p - r for r in range(p)}


def test_staleness_counts_steps_not_positions():
    """Moving a STEP, or updating every second microbatch, changes s accordingly."""
    sched = build_schedule("async-1f1b", 3, 6)
    rows = [[a for a in row if not (a.kind == STEP and a.microbatch % 2)] for row in sched.actions]
    halved = sched.with_actions(rows)
    assert staleness(halved, 0, 4) == 1  # STEP after B(2) only; B(3) has none
    assert staleness(sched, 0, 4) == 2


def test_async_variant_schedules_give_their_own_staleness():
    sched = build_schedule("async-zb-h1", 4, 8)
    s = steady_staleness(sched)
    assert all(s[r] >= 4 - r - 1 for r in range(4))  # W deferred: as stale as 1F1B or more
    from pipewright.features.async_weights import FEATURE
    from pipewright.schedules.registry import default_registry

    registry = default_registry().with_schedules(*FEATURE.schedules)
    sched = build_schedule("async-interleaved-1f1b", 2, 8, 2, registry=registry)
    assert steady_staleness(sched) == {0: 3, 1: 2, 2: 1, 3: 0}  # chunks 0, 2 on rank 0; 1, 3 on rank 1


# -- the policies' weights ----------------------------------------------------------------------
def _module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))


def _stage(policy: str, staleness=None, opt="sgd") -> tuple[nn.Module, AsyncStage]:
    mod = _module()
    o = (
        torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
        if opt == "sgd"
        else torch.optim.AdamW(mod.parameters(), lr=0.01)
    )
    return mod, AsyncStage(0, mod, o, make_policy(policy, 4, 1), staleness or {})


def _grads_of(mod: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    mod.zero_grad(set_to_none=True)
    mod(x).square().sum().backward()
    return [p.grad.clone() for p in mod.parameters()]


X = torch.randn(7, 5, generator=torch.Generator().manual_seed(9))
X2 = torch.randn(7, 5, generator=torch.Generator().manual_seed(10))


def _fb(mod, st, k, x):
    box = {}
    st.forward(k, lambda: box.update(out=mod(x)))
    return box


def _update(mod, st, x):
    box = _fb(mod, st, 99, x)
    st.backward(99, lambda: box["out"].square().sum().backward())
    st.update(lr=0.1, grad_scale=1.0, clip=0.0)


@pytest.mark.parametrize("policy", ["stash", "dc"])
def test_stash_backward_sees_exactly_the_forward_weights(policy):
    mod, st = _stage(policy)
    ref = copy.deepcopy(mod)
    want = _grads_of(ref, X)  # gradients at W0
    box = _fb(mod, st, 0, X)  # forward of microbatch 0 on W0
    _update(mod, st, X2)  # another microbatch's update: live weights are W1 now
    assert not torch.equal(mod[0].weight, ref[0].weight)
    assert st.policy.copies() == 1  # W0 kept because microbatch 0 still needs it
    for p in mod.parameters():
        p.grad = None
    st.backward(0, lambda: box["out"].square().sum().backward())
    for p, g in zip(mod.parameters(), want, strict=True):
        assert torch.equal(p.grad, g)
    assert st.policy.copies() == (1 if policy == "dc" else 0)  # dc: kept for its compensation


def test_none_backward_reads_the_live_weights():
    mod, st = _stage("none")
    box = _fb(mod, st, 0, X)
    _update(mod, st, X2)
    st.backward(0, lambda: box["out"].square().sum().backward())  # no in-place version error
    stale = _grads_of(copy.deepcopy(_module()), X)
    assert not torch.equal(mod[0].weight.grad, stale[0])


@pytest.mark.parametrize("policy", ["none", "stash", "predict"])
def test_nonfinite_gradient_skips_the_stage_update(policy):
    """--on-nonfinite skip: the update with a NaN gradient leaves weights and optimizer state as they
    were, the versions still count it, the message names the step, the stage and the parameter; the
    next finite update steps as usual."""
    mod, st = _stage(policy, {0: 1}, "adamw")
    st.on_nonfinite = "skip"
    _update(mod, st, X2)  # a finite update: optimizer state exists
    weights = [p.detach().clone() for p in mod.parameters()]
    state = copy.deepcopy(st.optimizer.state_dict())
    box = _fb(mod, st, 1, X)
    st.backward(1, lambda: box["out"].square().sum().backward())
    mod[3].bias.grad[0] = float("nan")
    version = st.version
    st.update(lr=0.1, grad_scale=1.0, clip=1.0, step=7, rank=2)
    assert all(torch.equal(p, w) for p, w in zip(mod.parameters(), weights, strict=True))
    assert str(st.optimizer.state_dict()) == str(state)
    assert st.version == version + 1 and all(p.grad is None for p in mod.parameters())
    assert st.nonfinite == [
        "step 7: non-finite values: nan gradient in stage 0, parameter 3.bias (rank 2); "
        "skipped stage 0's update (--on-nonfinite skip)"
    ]
    _update(mod, st, X2)
    assert not torch.equal(mod[0].weight, weights[0])


def test_nonfinite_gradient_stops_the_run_by_default():
    from pipewright.runtime.reliability.nonfinite import NonFiniteError

    mod, st = _stage("none")
    st.on_nonfinite = "stop"
    box = _fb(mod, st, 0, X)
    st.backward(0, lambda: box["out"].square().sum().backward())
    mod[0].weight.grad[0, 0] = float("inf")
    with pytest.raises(
        NonFiniteError, match=r"^step 3: non-finite values: inf gradient in stage 0, parameter 0\.weight"
    ):
        st.update(lr=0.1, grad_scale=1.0, clip=0.0, step=3)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_predicted_forward_leaves_weights_bit_identical(opt):
    mod, st = _stage("predict", {0: 3}, opt)
    _update(mod, st, X2)  # optimizer state and a latest gradient exist
    before = [p.detach().clone() for p in mod.parameters()]
    ptrs = [p.data_ptr() for p in mod.parameters()]
    box = _fb(mod, st, 0, X)
    for p, b, ptr in zip(mod.parameters(), before, ptrs, strict=True):
        assert torch.equal(p.detach(), b) and p.data_ptr() == ptr
    # the forward ran on Ŵ = W − lr·3·D(W)
    pred = {p: torch.empty_like(p) for p in mod.parameters()}
    predict_into(pred, st.optimizer, st.last_grads, 3)
    ref = copy.deepcopy(mod)
    with torch.no_grad():
        for q, p in zip(ref.parameters(), mod.parameters(), strict=True):
            q.copy_(pred[p])
    assert torch.equal(box["out"], ref(X))
    assert not torch.equal(box["out"], mod(X))
    assert st.policy.copies() == 1  # one prediction buffer, reused
    _fb(mod, st, 1, X2)
    assert st.policy.copies() == 1


# -- one stage: every policy is synchronous training ---------------------------------------------
def _fake_base(mod: nn.Module, xs, log: list):
    outs = {}

    def forward(state, a):
        outs[a.microbatch] = mod(xs[a.microbatch])
        log.append(float(outs[a.microbatch].detach().square().mean()))

    def backward(state, a):  # the executor's 1/M loss scale (M microbatches in the window)
        (outs.pop(a.microbatch).square().mean() / len(xs)).backward()

    return {F: forward, B: backward, STEP: lambda state, a: None}


def _sync_reference(xs, period: int, opt_name: str, policy: str = "none") -> list[float]:
    mod = _module()
    opt = policy_optimizer(policy, _optim(opt_name, mod))  # nesterov: the Nesterov form
    losses = []
    for i in range(0, len(xs), period):
        for x in xs[i : i + period]:
            out = mod(x).square().mean()
            losses.append(float(out.detach()))
            (out / period).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _optim(name, mod):
    if name == "sgd":
        return torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(mod.parameters(), lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_one_stage_every_policy_is_synchronous_training(policy, opt_name):
    m = 4
    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(20 + k)) for k in range(2 * m)]
    sched = build_schedule("async-1f1b", 1, m)  # two windows of m microbatches (state carries over)
    assert steady_staleness(sched) == {0: 0}
    mod = _module()
    log: list[float] = []
    lr = 0.05 if opt_name == "sgd" else 0.01
    rt = AsyncRuntime(sched, {0: mod}, {0: _optim(opt_name, mod)}, policy, period=m, lr_fn=lambda k: lr)
    for w in range(2):
        rt.set_schedule(sched)
        handlers = rt.handlers(_fake_base(mod, xs[w * m : (w + 1) * m], log))
        for a in sched.actions[0]:
            handlers[a.kind](None, a)
    want = _sync_reference(xs, m if policy == "2bw" else 1, opt_name, policy)
    assert log == want


# -- nesterov: the look-ahead update of Ajanthan et al. (ICML 2025) -------------------------------
def test_nesterov_policy_steps_with_the_look_ahead_update():
    """SGD(μ): b' = μb + g, W ← W − lr(g + μb') (the gradient's step plus the look-ahead along the
    new momentum); AdamW → NAdam with β₁ = 0.99: W ← W(1 − lr·λ) − lr·(μ_{t+1}m_t/(1 − Πμ_{≤t+1})
    + (1 − μ_t)g/(1 − Πμ_{≤t}))/(√v̂_t + ε), μ_t = β₁(1 − ½·0.96^{0.004t}), checked by hand."""
    gs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(40 + t)) for t in range(4)]
    p = _param(1)
    opt = policy_optimizer("nesterov", torch.optim.SGD([p], lr=0.1, momentum=0.9))
    w, b = p.detach().clone(), torch.zeros_like(p)
    for g in gs:
        p.grad = g.clone()
        opt.step()
        b = 0.9 * b + g
        w = w - 0.1 * (g + 0.9 * b)
        assert torch.allclose(p.detach(), w, atol=1e-6)
    p = _param(2)
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.99, 0.95, 1e-8
    opt = policy_optimizer("nesterov", torch.optim.AdamW([p], lr=lr, betas=(0.9, b2), weight_decay=wd))
    assert isinstance(opt, torch.optim.NAdam)
    w, m, v, prod = p.detach().double().clone(), 0.0, 0.0, 1.0
    for t, g in enumerate(gs, start=1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        w = w * (1 - lr * wd)
        mu, mu_next = (b1 * (1 - 0.5 * 0.96 ** (0.004 * k)) for k in (t, t + 1))
        prod *= mu
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)).sqrt() + eps
        w = w - lr * ((1 - mu) * g / (1 - prod) + mu_next * m / (1 - prod * mu_next)) / denom
        assert torch.allclose(p.detach().double(), w, atol=1e-6)
    with pytest.raises(ConfigError, match="nesterov"):
        policy_optimizer("nesterov", torch.optim.RMSprop([p]))


def test_evaluation_forward_runs_on_the_live_weights():
    """A forward without autograd (the trainer's evaluation) ignores the policy: with predict and
    s = 3 it sees W, not Ŵ, and records nothing for a backward."""
    sched = build_schedule("async-1f1b", 1, 2)
    mod = _module()
    rt = AsyncRuntime(sched, {0: mod}, {0: _optim("adamw", mod)}, "predict", period=1, lr_fn=lambda k: 0.01)
    st = rt.stages[0]
    _update(mod, st, X2)
    st.staleness = {0: 3}
    outs = []
    handlers = rt.handlers({F: lambda state, a: outs.append(mod(X)), B: None, STEP: None})
    # the executor does not warn of unreduced gradients, whether given the handlers or the wrapper
    assert handlers[STEP].reduces_gradients and rt.wrap.reduces_gradients
    with torch.no_grad():
        handlers[F](None, Action(0, F, 0))
    assert torch.equal(outs[0], mod(X).detach()) and st.policy.copies() == 0


# -- the trainer: pipewright train --schedule async-1f1b --weight-policy ... ----------------------
#: The tiny training run every trainer test starts from.
TINY = dict(
    model="gpt-tiny",
    layers=2,
    hidden=32,
    heads=2,
    seq_len=16,
    microbatch_size=2,
    steps=4,
    warmup=1,
    eval_every=0,
    progress=False,
    artifacts=False,
    lr=3e-3,
)


def _config(tmp_path, name: str, **kw):
    from pipewright.training import config_from_values

    return config_from_values({**TINY, "out": str(tmp_path / name), **kw})


def _records(result) -> list[dict]:
    import json

    return [json.loads(ln) for ln in result.files["metrics"].read_text().splitlines()]


def _train_each(rank: int, runs: list) -> list:
    """Worker: the trainer's loop (``train_worker``, as ``pipewright train`` runs it) over each run in
    turn, in one process group."""
    from pipewright.training import train_worker

    return [train_worker(rank, run) for run in runs]


#: the two-rank runs of the trainer checks below, all in one launch
ASYNC_P, ASYNC_M = 2, 4
DP_KW = dict(schedule="async-1f1b", pp=2, microbatches=2, steps=4, async_window=4, weight_policy="stash")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """Synchronous 1F1B with one microbatch per step (grad_clip 0); the asynchronous order F, B, STEP
    per microbatch (s = 0) on the same data; async-1f1b stash at dp = 1 with b = 4. One 2-process
    launch runs the three (``train_worker`` each, as ``pipewright train`` does)."""
    from dataclasses import replace

    from pipewright.ir import Action, Schedule, loop_placement
    from pipewright.training import prepare

    tmp_path = tmp_path_factory.mktemp("async-trainer")
    p, m = ASYNC_P, ASYNC_M
    sync = prepare(
        _config(tmp_path, "sync", schedule="1f1b", pp=p, microbatches=1, steps=8, warmup=4, grad_clip=0.0)
    )
    rows = [
        [a for k in range(m) for a in (Action(r, F, k), Action(r, B, k), Action(r, STEP, k))]
        for r in range(p)
    ]
    order = Schedule.build("async-no-overlap", m, rows, loop_placement(p), flush=False)
    asyn = _config(
        tmp_path, "async", steps=2, grad_clip=0.0, pp=p, microbatches=m, schedule="async-1f1b",
        weight_policy="predict", async_window=1,
    )  # fmt: skip
    dp1 = prepare(_config(tmp_path, "dp1-stash", microbatch_size=4, **DP_KW))
    runs = {"sync": sync, "async": replace(prepare(asyn), schedule=order), "dp1": dp1}
    return dict(zip(runs, fork_launch(_train_each, p, (list(runs.values()),))[0], strict=True))


@pytest.mark.slow
def test_trainer_async_without_staleness_equals_synchronous(two_rank_runs):
    """Two pipeline ranks running F, B, STEP per microbatch (an asynchronous order with s = 0) under
    the async trainer give the losses of synchronous 1F1B with one microbatch per step and 4× the
    steps (no clipping: the async runtime clips per stage, the synchronous one globally)."""
    sync, asyn = two_rank_runs["sync"].losses, two_rank_runs["async"].losses
    assert len(sync) == 8
    assert asyn == pytest.approx([sum(sync[i : i + 4]) / 4 for i in (0, 4)], rel=1e-6)


@pytest.mark.slow
def test_trainer_data_parallel_composes_and_reports_weight_versions(two_rank_runs, tmp_path):
    """dp = 2 with b = 2 equals dp = 1 with b = 4 (gradients averaged before each stage's update), and
    the weight versions the runtime reports are those the memory model gives for the window."""
    from pipewright.features.async_weights.weight_memory import weight_versions
    from pipewright.training import prepare

    one = two_rank_runs["dp1"]
    (two,) = fork_launch(_train_each, 4, ([prepare(_config(tmp_path, "dp2-stash", dp=2, **DP_KW))],))[0]
    assert two.losses == pytest.approx(one.losses, rel=2e-5)
    window = build_schedule("async-1f1b", 2, 8)
    want = {str(s): v for s, v in weight_versions("stash", window).items()}
    assert _records(one)[-1]["weight_versions"] == want == {"0": 2, "1": 1}


def test_trainer_refuses_bad_async_options():
    from pipewright.training import config_from_values, resolve_schedule

    def config(**values):
        return config_from_values(values)

    with pytest.raises(ConfigError, match="weight-policy"):
        resolve_schedule(config(schedule="async-1f1b", weight_policy="magic"))
    with pytest.raises(ConfigError, match="microbatches"):
        resolve_schedule(config(schedule="async-1f1b", weight_policy="2bw", pp=4, microbatches=2))
    with pytest.raises(ConfigError, match="run with --optimizer adamw or sgd \\(got kfac\\)"):
        resolve_schedule(config(schedule="async-1f1b", optimizer="kfac"))


def test_memory_model_per_policy():
    """Weight versions per stage (live included) from the schedule alone; the runtime reports the
    same (test above for stash; dc on async-zb-h1 measured 4 4 4 1 with m = 8)."""
    from pipewright.features.async_weights.weight_memory import weight_bytes, weight_versions

    one_f = build_schedule("async-1f1b", 4, 16)
    want = {
        "none": [1, 1, 1, 1],
        "stash": [4, 3, 2, 1],
        "dc": [4, 3, 2, 1],
        "2bw": [2] * 4,
        "predict": [2, 2, 2, 1],
        "nesterov": [4, 3, 2, 1],
    }
    assert {p: list(weight_versions(p, one_f).values()) for p in POLICIES} == want
    assert list(weight_versions("dc", build_schedule("async-zb-h1", 4, 8)).values()) == [4, 4, 4, 1]
    assert weight_versions("2bw", build_schedule("async-1f1b", 1, 4)) == {0: 1}
    assert weight_bytes("predict", one_f, dict.fromkeys(range(4), 10.0)) == {
        0: 30.0,
        1: 30.0,
        2: 30.0,
        3: 20.0,
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("policy", ["2bw", "predict"])
def test_checkpoints_carry_what_a_policy_keeps_between_windows(policy, tmp_path):
    """What 2bw (the previous weight version) and predict (the last gradient, the last update's lr)
    carry from one window to the next goes through a real checkpoint into a fresh runtime: versions,
    learning rates and tensors equal; a stage of another shape reads none of it."""
    from pipewright.runtime.checkpointing.checkpoint import load_checkpoint, save_checkpoint

    def runtime():
        mod = _module()
        rt = AsyncRuntime(
            build_schedule("async-1f1b", 1, 2),
            {0: mod},
            {0: _optim("adamw", mod)},
            policy,
            period=1,
            lr_fn=lambda k: 0.01,
        )
        rt.stages[0].policy.delay = 1  # 2bw: keep the previous version, as with stale microbatches
        return mod, rt

    mod, rt = runtime()
    st = rt.stages[0]
    for x in (X, X2):  # two windows of one update each (microbatch 0)
        rt.set_schedule(rt.schedule)
        box = _fb(mod, st, 0, x)
        st.backward(0, lambda box=box: box["out"].square().sum().backward())
        st.update(lr=0.1, grad_scale=1.0, clip=0.0)
    st.optimizer.param_groups[0]["lr"] = 0.003
    kept = st.policy.carried(st)
    assert list(kept) == (["shadow"] if policy == "2bw" else ["gradient"])
    params = dict(mod.named_parameters())
    save_checkpoint(tmp_path, 2, params, st.optimizer, meta={"fingerprint": "f"}, extra=rt)
    mod2, rt2 = runtime()
    load_checkpoint(
        tmp_path / "step_2",
        dict(mod2.named_parameters()),
        rt2.stages[0].optimizer,
        fingerprint="f",
        extra=rt2,
    )
    st2 = rt2.stages[0]
    assert (st2.version, st2.window_version) == (2, 2)
    assert [g["lr"] for g in st2.optimizer.param_groups] == [0.003]
    for name, tensors in kept.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, st2.policy.carried(st2)[name], strict=True))
    other = AsyncRuntime(
        build_schedule("async-1f1b", 1, 2),
        {0: nn.Linear(2, 2)},
        {0: _optim("adamw", nn.Linear(2, 2))},
        policy,
        period=1,
        lr_fn=lambda k: 0.01,
    )
    stored = {k: (tuple(t.shape), t.dtype) for k, t in rt.extra_state().items()}
    assert other.extra_wanted(stored) == []
