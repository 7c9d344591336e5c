"""The simulate path's calls back up the import layers, measured.

``pipewright simulate`` on a small run (Llama 3 8B, 8 H100s, pp 4 × tp 2, 8 microbatches, 1F1B) is
traced with ``sys.setprofile`` from ``cli/simulate.py``'s ``run``: every call from a function of
``src/pipewright`` to another one, counted once per (caller function, callee function). A call goes
*up* when its callee's module sits above its caller's: the callee's module imports the caller's
module, directly or through others (the import graph of tests/test_structure.py), or its package is
one the caller's package may not import (``FORBIDDEN`` there). A lower layer reaches a higher one only
through a value handed down to it: a callback, a hook, a plugin, a method of an object built above.

Measured when this test was written: 233 distinct calls through 60 modules, 10 of them up, all
through an object handed down: 9 from ``cost/chunk_memory.py`` and ``cost/kernels.py`` into
:class:`~pipewright.cost.transformer.TransformerCost`'s methods (the cost model passed to the helpers
it imports), 1 from ``schedules/registry.py`` into the generator it holds (``classic.one_f_one_b``),
and none across packages. The goal is at most 8 (:data:`GOAL`); :data:`CEILING` holds today's count
and is lowered as calls move (the failure lists the calls up).
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
#: The most calls up the simulate path may make today; lower it as calls are moved, down to GOAL.
CEILING = 10
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


@functools.cache
def simulate_path() -> set[Edge]:
    import contextlib
    import io

    from pipewright.cli import _parser

    args = _parser((), "simulate").parse_args(ARGV)
    with contextlib.redirect_stdout(io.StringIO()):
        edges = trace_calls(lambda: args.func(args))
    return edges


def test_the_tracer_sees_a_call_up() -> None:
    """A cost model calling a feature's cost rule (a callback: the feature imports the cost model)."""
    assert goes_up("pipewright.cost.rules", "pipewright.features.vocab.cost")
    assert not goes_up("pipewright.cli.simulate", "pipewright.sim.engine")
    assert goes_up("pipewright.runtime.core.trainer", "pipewright.training.workers")  # FORBIDDEN's


def test_the_simulate_path_calls_up_the_layers_at_most_the_ceiling() -> None:
    edges = simulate_path()
    assert len(edges) > 50  # the whole path was traced: cli → plan → cost → sim → metrics
    up = calls_up(edges)
    listed = "\n".join(f"{a} -> {b}" for a, b in up)
    assert len(up) <= CEILING, f"{len(up)} calls up the import layers (at most {CEILING}):\n{listed}"
    crossing = [(a, b) for a, b in up if a.split(".")[1] != b.split(".")[1]]
    assert not crossing, f"calls up across packages: {crossing}"
