"""The simulate path's calls back up the import layers, measured.

``pipewright simulate`` on a small run (Llama 3 8B, 8 H100s, pp 4 × tp 2, 8 microbatches, 1F1B) is
traced with ``sys.setprofile`` from ``cli/simulate.py``'s ``run``: every call from a function of
``src/pipewright`` to another one, counted once per (caller function, callee function). A call goes
*up* when its callee's module sits above its caller's: the callee's module imports the caller's
module, directly or through others (the import graph of tests/test_structure.py), or its package is
one the caller's package may not import (``FORBIDDEN`` there). A lower layer reaches a higher one only
through a value handed down to it: a callback, a hook, a plugin, a method of an object built above.

Two kinds of call up are the project's extension mechanism, extension by registration, and are listed
apart (:func:`registered`) rather than counted against the ceiling:

- a registry calling what registered in it: ``schedules/registry.py``'s ``build_schedule`` calls the
  generator a schedule family module exports in its ``SCHEDULES`` (``classic.one_f_one_b``); the
  registry is open (features add schedules with ``with_schedules``) and cannot import its entries;
- the core calling a feature's hooks: the kinds (dependency and participant rules), cost rules and the
  cost model a feature registers (``Features``), called through the kinds table and the
  ``CostModel``/``Comm`` protocols. The core may not import ``pipewright.features`` (``FORBIDDEN``),
  so every such call is one into an object the feature handed down.

Measured on 2026-12-07 (before → after moving cost/chunk_memory.py and cost/kernels.py onto the
values of :class:`~pipewright.cost.cost_inputs.CostInputs`): the plain run 10 → 1 call up (234
distinct calls through 61 modules): the registry's one; the 9 from ``cost/chunk_memory.py`` and
``cost/kernels.py`` into :class:`~pipewright.cost.transformer.TransformerCost`'s methods are gone.
With ``--vocab-parallel alg1`` (:data:`VOCAB_ARGV`; 298 distinct calls through 69 modules) 33 → 24: 19
registered (the registry's, 18 into the feature's hooks) and 5 others: 3 inside the feature (its
placement's cost function handed down to ``insert.py``/``reference_choice.py``), ``kinds.py``
calling the ``deps.py`` pattern a kind holds, and ``deps.py`` reading ``Schedule.actions`` (a property
``ir.py`` defines). Since the family modules import ``schedules/schedule_info.py`` rather than the
registry, the registry's call into a generator is no call up: the plain run makes none.
:data:`CEILING` and :data:`VOCAB_CEILING` hold today's counts of unregistered calls up; the goal for
the whole plain path is at most 8 (:data:`GOAL`). The failure lists the calls.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from test_structure import FORBIDDEN, SRC, _under, graph, modules

ARGV = [
    "simulate",
    *("--model", "llama3-8b", "--gpu", "h100-sxm", "--pp", "4", "--tp", "2"),
    *("--microbatches", "8", "--schedule", "1f1b"),
]
VOCAB_ARGV = [*ARGV, "--vocab-parallel", "alg1"]
#: The most calls up outside registration each path may make (today's counts); GOAL: all calls up
#: of the plain path, registered ones included.
CEILING = 0
VOCAB_CEILING = 5
GOAL = 8

Edge = tuple[str, str]  # ("module:function", "module:function")


@functools.cache
def _module_of(filename: str) -> str | None:
    path = Path(filename)
    if path.suffix != ".py" or not path.is_relative_to(SRC):
        return None
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    name = ".".join(parts)
    return name if name in modules() else None


def trace_calls(run: Callable[[], Any]) -> set[Edge]:
    """Every distinct call between two functions under src/pipewright while ``run`` runs."""
    edges: set[Edge] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = _module_of(frame.f_code.co_filename)
        caller = _module_of(frame.f_back.f_code.co_filename)
        if callee and caller and callee != caller:
            edges.add((f"{caller}:{frame.f_back.f_code.co_qualname}", f"{callee}:{frame.f_code.co_qualname}"))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return edges


@functools.cache
def _above() -> dict[str, set[str]]:
    """Module → every module that imports it, directly or through others."""
    importers: dict[str, set[str]] = {m: set() for m in modules()}
    for m, targets in graph().items():
        for t in targets:
            importers[t].add(m)
    out: dict[str, set[str]] = {}
    for m in modules():
        seen, todo = set(), [m]
        while todo:
            for up in importers[todo.pop()] - seen:
                seen.add(up)
                todo.append(up)
        out[m] = seen
    return out


def goes_up(caller: str, callee: str) -> bool:
    """Whether module ``callee`` sits above module ``caller`` (by imports, or by FORBIDDEN)."""
    if callee in _above()[caller]:
        return True
    return any(
        _under(caller, low) and any(_under(callee, h) for h in high) for low, high in FORBIDDEN.items()
    )


def calls_up(edges: set[Edge]) -> list[Edge]:
    return sorted(e for e in edges if goes_up(e[0].split(":")[0], e[1].split(":")[0]))


#: a registry's lookup → the entries registered in it (module docstring)
REGISTRIES = {"pipewright.schedules.registry:build_schedule"}


def registered(edge: Edge) -> bool:
    """Whether a call up is a callback into something registered (module docstring): a registry
    calling an entry, or the core (outside ``pipewright.features``) calling a feature's hook."""
    caller, callee = edge
    if caller in REGISTRIES:
        return True
    return callee.startswith("pipewright.features.") and not caller.startswith("pipewright.features.")


def package(function: str) -> str:
    """``pipewright.cost.kernels:f`` → ``cost``; ``pipewright.ir:f`` (a top-level module) → ``pipewright``."""
    parts = function.split(":")[0].split(".")
    return parts[1] if len(parts) > 2 else parts[0]


@functools.cache
def simulate_path(argv: tuple[str, ...] = tuple(ARGV)) -> set[Edge]:
    import contextlib
    import io

    from pipewright.cli import _parser

    args = _parser((), "simulate").parse_args(list(argv))
    with contextlib.redirect_stdout(io.StringIO()):
        edges = trace_calls(lambda: args.func(args))
    return edges


def test_the_tracer_sees_a_call_up() -> None:
    """A cost model calling a feature's cost rule (a callback: the feature imports the cost model)."""
    assert goes_up("pipewright.cost.rules", "pipewright.features.vocab.cost")
    assert not goes_up("pipewright.cli.simulate", "pipewright.sim.engine")
    assert goes_up("pipewright.runtime.core.trainer", "pipewright.training.workers")  # FORBIDDEN's
    assert registered(("pipewright.cost.rules:RuledCost._cost", "pipewright.features.vocab.cost:f"))
    assert not registered(("pipewright.cost.kernels:layer_traffic", "pipewright.cost.transformer:T.f"))


def _check(argv: list[str], ceiling: int) -> list[Edge]:
    """The calls up of the path of ``argv``: at most ``ceiling`` outside registration, none of those
    across packages; returns all of them."""
    edges = simulate_path(tuple(argv))
    assert len(edges) > 50  # the whole path was traced: cli → plan → cost → sim → metrics
    up = calls_up(edges)
    others = [e for e in up if not registered(e)]
    listed = "\n".join(f"{a} -> {b}" for a, b in others)
    assert len(others) <= ceiling, f"{len(others)} calls up the import layers (at most {ceiling}):\n{listed}"
    crossing = [(a, b) for a, b in others if package(a) != package(b)]
    assert not crossing, f"calls up across packages: {crossing}"
    return up


def test_the_simulate_path_calls_up_the_layers_at_most_the_ceiling() -> None:
    up = _check(ARGV, CEILING)
    assert len(up) <= GOAL, up
    assert up == []  # (the registry's call into classic.one_f_one_b is not up: classic imports
    # schedule_info.py, not the registry that loads it)


def test_the_vocabulary_parallel_path_calls_up_only_through_its_hooks_and_the_ceiling() -> None:
    up = _check(VOCAB_ARGV, VOCAB_CEILING)
    hooks = [e for e in up if registered(e) and e[0] not in REGISTRIES]
    assert hooks and all(b.startswith("pipewright.features.vocab.") for _, b in hooks), hooks
