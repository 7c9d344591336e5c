"""The registration contract: a feature defined entirely in this file — a compute kind with a payload,
a point-to-point pair and a collective over the pipeline group, with cost rules and runtime handlers —
validates, lowers, simulates (the collective's rendezvous visible in the timeline) and executes on gloo,
with no edit to any file under src/. The executor's handler-wrapper hook is exercised the same way:
wrappers defined here wrap every kind's handler of the run. A second feature defined here, with an
option section and a training plugin, runs through ``pipewright train --feature`` end to end (its
flags, its TOML table, the plugin's calls in order, its checkpoint state on ``--resume``) and is found
through the ``pipewright.features`` entry point group.

The toy feature ("TOY"): after each forward F(s, k), for layers j = 0, 1, stage s computes
``value = sum(input of stage s) · (j + 1) + value of stage s − 1`` (received through
TOY_SEND/TOY_RECV when the previous stage is on another rank), then all pipeline ranks all-reduce
that value (TOY_AR, group pp).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipewright.cost.rules import ActionCost
from pipewright.cost.unit import UnitCost
from pipewright.deps import after, from_stage, matching_send
from pipewright.errors import ConfigError, ValidationError
from pipewright.features import Feature, Features
from pipewright.ir import Action, Collective, F, KindSpec, Schedule
from pipewright.kinds import P2P
from pipewright.options import option, section_of
from pipewright.passes import lower, validate
from pipewright.runtime.core.plugin import Built, ExecutorParts, TrainingPlugin
from pipewright.schedules import build_schedule
from pipewright.sim import simulate

LAYERS = (0, 1)
HIDDEN, MB = 4, 2


def _toy_requires(a: Action, s: Schedule) -> tuple:
    return ((F, a.stage, a.microbatch, None), *from_stage(s, a, "TOY", a.stage - 1, "TOY_RECV"))


def _toy_complete(schedule: Schedule):
    for s in range(schedule.num_stages):
        for k in range(schedule.num_microbatches):
            for j in LAYERS:
                yield ("TOY", s, k, j), "TOY"


def _ar_requires(a: Action, s: Schedule) -> tuple:
    return (("TOY", a.stage, a.microbatch, a.payload),)


def _toy_cost(a: Action, s: Schedule, base) -> ActionCost:
    return ActionCost(time=0.5, flops=3.0)


def _ar_cost(a: Action, s: Schedule, base) -> ActionCost:
    return ActionCost(message_bytes=8.0)


# -- runtime handlers (torch) -------------------------------------------------------------------
def _toy_handler(state, a: Action) -> None:
    ex, (s, k, j) = state.executor, (a.stage, a.microbatch, a.payload)
    value = state.stage_inputs[(s, k)].detach().float().sum().reshape(1) * (j + 1)
    if s > 0:
        if ex.schedule.local(s - 1, s):
            value = value + state.scratch[("toy", s - 1, k, j)]
        else:
            value = value + state.received.pop(Action(s, "TOY_RECV", k, j))
    state.scratch[("toy", s, k, j)] = value
    if s + 1 < ex.schedule.num_stages and not ex.schedule.local(s, s + 1):
        state.outbox[Action(s, "TOY_SEND", k, j)] = value.clone()


def _ar_handler(state, a: Action) -> None:
    value = state.scratch[("toy", a.stage, a.microbatch, a.payload)].clone()
    work = dist.all_reduce(value, group=state.executor.group("pp"), async_op=True)
    work.wait()
    state.scratch.setdefault("reduced", {})[(a.microbatch, a.payload)] = value.item()


def _executor_parts() -> ExecutorParts:
    return ExecutorParts(
        handlers={"TOY": _toy_handler, "TOY_AR": _ar_handler},
        tensor_specs={"toy": lambda a: ((1,), torch.float32)},
    )


TOY = Feature(
    name="toy",
    kinds=(
        KindSpec("TOY", _toy_requires, complete=_toy_complete, per_microbatch=True, description="toy"),
        KindSpec(
            "TOY_SEND",
            after("TOY"),
            compute=False,
            p2p=P2P("send", "TOY_RECV", +1, "toy", attach=("TOY",)),
            per_microbatch=True,
        ),
        KindSpec(
            "TOY_RECV",
            matching_send,
            compute=False,
            p2p=P2P("recv", "TOY_SEND", -1, "toy", attach=("TOY",)),
            per_microbatch=True,
        ),
        KindSpec(
            "TOY_AR",
            _ar_requires,
            compute=False,
            collective=Collective("all_reduce", "pp"),
            per_microbatch=True,
        ),
    ),
    cost_rules={"TOY": _toy_cost, "TOY_AR": _ar_cost},
)
FEATURES = Features([TOY])


def toy_pass(schedule: Schedule) -> Schedule:
    """After each F: the TOY tasks of both layers, then their all-reduces."""
    rows = []
    for row in schedule.actions:
        out = []
        for a in row:
            out.append(a)
            if a.kind == F:
                out += [Action(a.stage, "TOY", a.microbatch, j) for j in LAYERS]
                out += [Action(a.stage, "TOY_AR", a.microbatch, j) for j in LAYERS]
        rows.append(out)
    return schedule.with_actions(rows, kinds=FEATURES.kinds)


def toy_schedule(name: str = "1f1b", p: int = 2, m: int = 2) -> Schedule:
    return toy_pass(build_schedule(name, p, m))


class ConstComm:
    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return 0.25

    def collective_time(self, kind, rank, nbytes, group="dp", members=()) -> float:
        assert group == "pp" and kind == "all_reduce" and nbytes == 8.0
        return 0.75


# -- pure side ----------------------------------------------------------------------------------
def test_the_toy_feature_validates_and_lowers_from_metadata() -> None:
    sched = toy_schedule()
    validate(sched)
    low = lower(sched)
    validate(low)
    rows = [[str(a) for a in row] for row in low.actions]
    # each TOY of stage 0 is followed by its send, each TOY of stage 1 preceded by its receive
    assert rows[0][rows[0].index("0TOY0:1") + 1] == "0TOY_SEND0:1"
    assert rows[1][rows[1].index("1TOY0:1") - 1] == "1TOY_RECV0:1"
    # payloads keep the two layers' events apart (no "computes twice")
    assert sum(a.kind == "TOY" for row in low.actions for a in row) == 2 * 2 * len(LAYERS)


def test_the_validator_applies_the_features_rules() -> None:
    sched = toy_schedule()
    # completeness: a missing TOY task is named
    rows = [[a for a in row if a != Action(1, "TOY", 1, 0)] for row in sched.actions]
    with pytest.raises(ValidationError, match="missing 1TOY1:0"):
        validate(sched.with_actions(rows))
    # a collective over pp without its counterpart on the other rank
    rows = [[a for a in row if a != Action(1, "TOY_AR", 0, 1)] for row in sched.actions]
    with pytest.raises(ValidationError, match="no counterpart on rank 1"):
        validate(sched.with_actions(rows))
    # members issuing the group's collectives in different orders
    rows = [list(r) for r in sched.actions]
    i, j = rows[1].index(Action(1, "TOY_AR", 0, 0)), rows[1].index(Action(1, "TOY_AR", 0, 1))
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    with pytest.raises(ValidationError, match="one order"):
        validate(sched.with_actions(rows))


def test_the_toy_feature_simulates_with_its_costs_and_a_rendezvous() -> None:
    sched = toy_schedule()
    cost = FEATURES.cost(UnitCost())
    result = simulate(sched, cost, comm=ConstComm())
    ar = {}
    for span in result.timeline.spans:
        if span.action.kind == "TOY_AR":
            ar.setdefault((span.action.microbatch, span.action.payload), []).append(span)
        if span.action.kind == "TOY":
            assert span.duration == 0.5
    assert len(ar) == 2 * len(LAYERS)
    for spans in ar.values():
        # both members' spans start and end together: the rendezvous, on the comm stream
        assert len(spans) == 2 and {s.stream for s in spans} == {"comm"}
        assert spans[0].start == spans[1].start and spans[0].end == spans[1].end
        assert spans[0].duration == 0.75
    # it starts when the later member issued it: rank 1's TOY of that microbatch (after the recv)
    r1 = {str(a): (s, e) for a, s, e in result.spans_of(1)}
    r0 = {str(a): (s, e) for a, s, e in result.spans_of(0)}
    assert r0["0TOY_AR0:0"][0] == r1["1TOY_AR0:0"][0] >= r1["1TOY0:1"][1]
    assert result.flops == 3.0 * 2 * 2 * len(LAYERS) + sum(result.busy) - 0.5 * 2 * 2 * len(LAYERS)


# -- runtime ------------------------------------------------------------------------------------
class _Stage(nn.Module):
    def __init__(self, first: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(7, HIDDEN) if first else None
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        return torch.tanh(self.lin(x))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 7, (MB, 3), generator=g) for _ in range(m)]
    targets = [torch.randn(MB, 3, HIDDEN, generator=g) for _ in range(m)]
    return tokens, targets


def _expected(p: int, m: int) -> dict:
    """Single process: the toy values and their all-reduced sums."""
    stages = [_Stage(s == 0, 10 + s) for s in range(p)]
    tokens, _ = _batch(m)
    out = {}
    with torch.no_grad():
        for k in range(m):
            x = tokens[k]
            acc = dict.fromkeys(LAYERS, 0.0)
            per_stage = []
            for st in stages:
                for j in LAYERS:
                    acc[j] = acc[j] + x.float().sum().item() * (j + 1)
                per_stage.append(dict(acc))
                x = st(x)
            for j in LAYERS:
                out[(k, j)] = sum(v[j] for v in per_stage)
    return out


def _tracing(tag: str, calls: list):
    """A handler wrapper (``PipelineExecutor.wrap_handlers``) that logs (tag, action) before each action."""

    def wrapper(kind: str, handler):
        def wrapped(state, a: Action) -> None:
            calls.append((tag, str(a)))
            handler(state, a)

        return wrapped

    return wrapper


def _toy_worker(rank: int, p: int, m: int) -> dict:
    from pipewright.runtime import ParallelMesh, PipelineExecutor

    torch.set_num_threads(1)
    mesh = ParallelMesh.build(1, p, 1)
    sched = toy_schedule("1f1b", p, m)
    parts = _executor_parts()
    stages = {s: _Stage(s == 0, 10 + s) for s in sched.stages_of(mesh.pp_rank)}
    seen: dict = {}
    calls: list = []

    def spy(kind: str, handler):  # a wrapper for one kind, leaving the others alone
        if kind != "TOY_AR":
            return handler

        def wrapped(state, a: Action) -> None:
            handler(state, a)
            seen.update(state.scratch["reduced"])

        return wrapped

    ex = PipelineExecutor(
        sched,
        mesh,
        stages,
        loss_fn=_loss,
        boundary_shape=(MB, 3, HIDDEN),
        recv_timeout_s=60,
        **parts.merged(ExecutorParts(handler_wrappers=(spy, _tracing("inner", calls)))).executor_kwargs(),
    )
    ex.wrap_handlers(_tracing("outer", calls))  # registered after construction: runs first
    tokens, targets = _batch(m)
    losses = ex.run(tokens, targets)
    return {"reduced": seen, "losses": losses, "calls": calls, "row": [str(a) for a in ex.actions]}


@pytest.fixture(scope="module")
def toy_run() -> list[dict]:
    from pipewright.runtime import spawn

    return spawn(_toy_worker, 2, (2, 3), timeout_s=300)


@pytest.mark.slow
def test_the_toy_feature_executes_on_gloo(toy_run) -> None:
    expected = _expected(2, 3)
    for r in toy_run:
        assert set(r["reduced"]) == set(expected)
        for key, value in expected.items():
            assert r["reduced"][key] == pytest.approx(value, rel=1e-5)
    assert len(toy_run[-1]["losses"]) == 3


@pytest.mark.slow
def test_handler_wrappers_plug_in_around_every_kind(toy_run) -> None:
    """The handler-wrapper hook: wrappers defined here see every action of the rank's row — core,
    point-to-point and the feature's kinds — once, in order, the later-registered one outermost; a
    wrapper that returns the handler it was given leaves a kind alone (the spy above wraps TOY_AR only)."""
    for r in toy_run:
        assert {a.rstrip("0123456789:").lstrip("0123456789") for a in r["row"]} >= {"F", "B", "TOY", "TOY_AR"}
        assert r["calls"] == [(tag, a) for a in r["row"] for tag in ("outer", "inner")]


# -- schedules: an open registry, and generators that take costs -------------------------------
def test_features_register_schedules_and_zb_auto_plans_with_real_costs() -> None:
    from pipewright.cost.transformer import TransformerCost
    from pipewright.models.presets import get_preset
    from pipewright.schedules import ScheduleInfo, default_registry, schedule_names
    from pipewright.schedules.registry import build_schedule as build
    from pipewright.schedules.schedule_costs import schedule_costs

    def reversed_gpipe(p: int, m: int, v: int) -> Schedule:
        base = build_schedule("gpipe", p, m)
        return base.with_actions(base.actions, name="toy-gpipe")

    entry = ScheduleInfo(
        name="toy-gpipe",
        build=reversed_gpipe,
        memory=lambda p, m, v: [m] * p,
        bubble="(p − 1)/m",
        memory_formula="m",
        source="test",
    )
    registry = default_registry().with_schedules(entry)
    assert "toy-gpipe" in schedule_names(registry) and "toy-gpipe" not in schedule_names()
    assert build("toy-gpipe", 3, 4, registry=registry).name == "toy-gpipe"

    # zb-auto with the transformer cost model's stage times: uneven stages (the last holds the
    # output layer) give another order than unit costs, and the simulated time is no worse than
    # the unit-cost zb-auto's under those real costs
    p, m = 4, 8
    from pipewright.cost.comm import Mesh

    cost = TransformerCost(get_preset("gpt3-xl"), microbatch=1, dtype="bf16", mesh=Mesh(pp=p))
    costs = schedule_costs(cost, p)
    assert costs.f[-1] > costs.f[0]
    real = build("zb-auto", p, m, costs=costs)
    unit = build("zb-auto", p, m)
    assert real.actions != unit.actions
    assert simulate(real, cost).iteration_time <= simulate(unit, cost).iteration_time * (1 + 1e-9)


def test_simulate_plans_zb_auto_with_the_models_costs(capsys) -> None:
    """`pipewright simulate --model … --schedule zb-auto` builds zb-auto from that model's stage times."""
    from pipewright.cli import main

    args = ["simulate", "--model", "gpt3-xl", "--gpu", "a100-80gb", "--nodes", "1", "--gpus-per-node", "4"]
    args += ["--pp", "4", "--microbatch-size", "1", "--microbatches", "8", "--json"]
    times = {}
    for name in ("zb-auto", "zb-h1"):
        assert main([*args, "--schedule", name]) == 0
        import json

        times[name] = json.loads(capsys.readouterr().out)["iteration_time_s"]
    # planned with the real (uneven: the last stage holds the output layer) costs, no worse than ZB-H1
    assert times["zb-auto"] <= times["zb-h1"] * (1 + 1e-9)


# -- a training feature of one's own through `pipewright train` ---------------------------------
@dataclass(frozen=True)
class ToyOptions:
    """The toy training feature's options: TOML ``[toy]``, flags ``--toy-level`` and ``--toy-note``."""

    level: int = option(1, "--toy-level", "how many TOYMARK actions follow each forward")
    note: str = option("none", "--toy-note", "a word the plugin records")


def _journal(config, rank: int | None, event: str, **data) -> None:
    """Append one lifecycle event of the toy plugin to ``out/toy-<rank>.jsonl`` (rank None: launcher)."""
    name = "launcher" if rank is None else f"rank{rank}"
    with (Path(config.out) / f"toy-{name}.jsonl").open("a") as f:
        f.write(json.dumps({"event": event, **data}) + "\n")


def _mark_requires(a: Action, s: Schedule) -> tuple:
    return ((F, a.stage, a.microbatch, None),)


class ToyPlugin(TrainingPlugin):
    """Every call of the protocol, journaled: it rewrites the schedule (``level`` TOYMARK actions
    after each F), keeps the default optimizer, handles TOYMARK and counts the forwards with a handler
    wrapper, and carries the count in checkpoints."""

    @classmethod
    def active(cls, config, schedule) -> bool:
        return section_of(config, ToyOptions).level > 0

    @classmethod
    def check(cls, config, schedule, spec) -> None:
        if section_of(config, ToyOptions).level > 5:
            raise ConfigError("--toy-level must be at most 5")
        if spec is not None:
            Path(config.out).mkdir(parents=True, exist_ok=True)
            _journal(config, None, "check", layers=spec.layers)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.options = section_of(config, ToyOptions)
        self.rank = dist.get_rank()
        self.marks = 0
        self.count = _ToyCount(self)

    def build(self, ctx) -> Built:
        kinds = ctx.schedule.kinds.with_kinds(KindSpec("TOYMARK", _mark_requires, per_microbatch=True))
        rows = [
            [x for a in row for x in [a] + [Action(a.stage, "TOYMARK", a.microbatch, j) for j in range(
                self.options.level) if a.kind == F]]
            for row in ctx.schedule.actions
        ]  # fmt: skip
        _journal(self.config, self.rank, "build", stages=sorted(ctx.stages), note=self.options.note)
        return Built(schedule=ctx.schedule.with_actions(rows, kinds=kinds))

    def optimizer(self, ctx):
        _journal(
            self.config, self.rank, "optimizer", type=type(ctx.optimizer).__name__, params=len(ctx.params)
        )
        return ctx.optimizer

    def executor_parts(self, ctx) -> ExecutorParts:
        def mark(state, a: Action) -> None:
            self.marks += 1

        def count(kind: str, handler):
            if kind != F:
                return handler

            def wrapped(state, a: Action) -> None:
                self.count.forwards += 1
                handler(state, a)

            return wrapped

        _journal(self.config, self.rank, "executor_parts")
        return ExecutorParts(handlers={"TOYMARK": mark}, handler_wrappers=(count,))

    def after_run(self) -> None:
        _journal(self.config, self.rank, "after_run", marks=self.marks)

    def evaluate(self, executor, inputs, targets):
        _journal(self.config, self.rank, "evaluate")
        return None  # the executor's own forward-only pass

    def extra_state(self) -> _ToyCount:
        return self.count


class _ToyCount:
    """The toy's checkpoint state (:class:`~pipewright.runtime.checkpointing.checkpoint.ExtraState`): the
    forwards this
    rank ran, under a per-rank key."""

    def __init__(self, plugin: ToyPlugin) -> None:
        self.plugin, self.key, self.forwards = plugin, f"toy/rank{plugin.rank}", torch.zeros(1)

    def extra_state(self) -> dict:
        _journal(self.plugin.config, self.plugin.rank, "save", forwards=int(self.forwards.item()))
        return {self.key: self.forwards.clone()}

    def extra_wanted(self, stored) -> list[str]:
        return [k for k in stored if k == self.key]

    def load_extra_state(self, state: dict) -> None:
        self.forwards = state[self.key].clone()
        _journal(self.plugin.config, self.plugin.rank, "load", forwards=int(self.forwards.item()))


TOY_TRAINING = Feature(
    name="toytrain",
    section=ToyOptions,
    table="toy",
    plugin=f"{__name__}:ToyPlugin",
    description="a feature defined in a test",
)


def _events(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"toy-rank{rank}.jsonl").read_text().splitlines()]


TRAIN = [
    "train",
    "--layers",
    "2",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--microbatch-size",
    "1",
]
TRAIN += ["--microbatches", "2", "--no-progress", "--no-artifacts", "--eval-every", "2", "--optimizer", "sgd"]
TRAIN += ["--feature", f"{__name__}:TOY_TRAINING"]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> str:
    from pipewright.data.tokens import write_tokens

    path = tmp_path_factory.mktemp("toydata") / "tokens.bin"
    text = np.frombuffer(b"a toy feature trains through the command line. " * 200, dtype=np.uint8)
    write_tokens(path, text.astype(np.int64), vocab_size=256)
    return str(path)


@pytest.mark.slow
def test_a_feature_of_ones_own_trains_through_the_command_line(toy_data, tmp_path, capsys) -> None:
    from pipewright.cli import main

    out = tmp_path / "run"
    toml = tmp_path / "train.toml"
    toml.write_text("[train]\nsteps = 2\n\n[toy]\nlevel = 2\n")
    common = [*TRAIN, "--data", toy_data, "--out", str(out), "--config", str(toml)]
    assert main([*common, "--toy-note", "hello", "--checkpoint-every", "2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["toy_level"], config["toy_note"]) == (2, "hello")  # the TOML table and the flag
    assert [e["event"] for e in _events(out, 0)] == [
        "build",
        "optimizer",
        "executor_parts",
        "after_run",
        "after_run",
        "evaluate",
        "evaluate",
        "save",
    ]  # fmt: skip (two evaluation batches)
    launcher = [json.loads(line) for line in (out / "toy-launcher.jsonl").read_text().splitlines()]
    assert launcher == [{"event": "check", "layers": 2}]
    for rank in (0, 1):
        events = {e["event"]: e for e in _events(out, rank)}
        assert events["build"]["note"] == "hello" and events["build"]["stages"] == [rank]
        assert events["optimizer"]["type"] == "SGD"
        assert events["after_run"]["marks"] == 2 * 2 * 2  # level 2 marks after each F, 2 mbs, 2 steps
        assert events["save"]["forwards"] == 2 * 2 + 2 * 2  # 2 steps of 2 mbs, 2 evaluation batches

    # --resume: the plugin's checkpoint state comes back, then the run goes on
    assert main([*common, "--toy-note", "hello", "--steps", "3", "--resume"]) == 0
    for rank in (0, 1):
        loads = [e for e in _events(out, rank) if e["event"] == "load"]
        assert loads == [{"event": "load", "forwards": 8}]

    # a check of the feature refuses before any worker starts; its flags are in `train --help`
    assert main([*common, "--toy-level", "9"]) == 2
    assert "--toy-level must be at most 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--feature", f"{__name__}:TOY_TRAINING", "--help"])
    text = capsys.readouterr().out
    assert "toytrain: a feature defined in a test" in text and "(default: 1)" in text


def test_features_are_found_through_the_entry_point_group(tmp_path, monkeypatch) -> None:
    from pipewright.features import all_features

    info = tmp_path / "toy_feature-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-feature\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[pipewright.features]\ntoy = {__name__}:TOY_TRAINING\n")
    assert "toytrain" not in {f.name for f in all_features()}
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toytrain" in {f.name for f in all_features()}
