"""Megatron-LM's partial full recomputation: ``--recompute-granularity full --recompute-method
uniform|block --recompute-num-layers N``.

Megatron-Core's ``checkpointed_forward`` (``megatron/core/recompute.py``, called from
``TransformerBlock`` when ``recompute_granularity == "full"``; NVIDIA/Megatron-LM d98e8a6, 2026-08)
runs each pipeline chunk — one ``TransformerBlock``, a virtual chunk under interleaving — of n layers
as:

- ``block``: layers 0 … k − 1, k = min(N, n), each checkpointed alone (``tensor_parallel.checkpoint``
  of one layer: its input kept, its forward re-run at the start of its backward); layers k … n − 1
  run normally and keep all their activations (no recomputation).
- ``uniform``: groups [0, N), [N, 2N), …, the last one cut at n, each one checkpoint: only the group's
  input is kept, and the whole group's forward is re-run in its backward. ⌈n/N⌉ inputs are kept.

``--recompute full`` alone is ``uniform`` with N = 1 (what Megatron-LM's own GPT scripts pass).
Megatron-Core skips checkpointing the first layers of a block whose input needs no gradient under
FP8 (``recompute_skip_num_layers``); not priced.

Priced from two one-mode cost models of the spec's class (``none`` and ``full``) and their chunk
tables for prefixes of the chunk: X(j) is the ``X`` model's chunk holding the chunk's first j layers
(the same embedding/output roles, the same layer indices: a mixture of experts' dense and expert
layers stay where they are), so X(b) − X(a) is what layers a … b − 1 add under mode X.

- Time, FLOPs, communication and memory per kind (F, B, I, W): ``block`` none(n) + full(k) − none(k)
  (each term's time as its one-mode model prices it, tensor-parallel overlap and all-to-alls
  included); ``uniform`` full(n), less the inputs of the layers that start no group:
  F − (S_full(0, n) − Σ_groups S_full(a, a + 1)) and the same less freed by B and I, where
  S_X(a, b) = X(b)[F] − X(a)[F].
- The recomputation transient of a chunk's B or I (on top of the live bytes before it;
  :mod:`pipewright.sim.memory`): the backward visits the groups last to first (``block``: the
  n − k unrecomputed layers first, then single-layer groups); re-running group [a, b) re-creates
  S_none(a, b) − S_full(a, a + 1) bytes (its input is the checkpoint's own tensor), while the output
  layer's kept tensors (last chunk) and everything the later layers' backward of that kind freed
  are gone: the transient is max over groups of (re-created − freed before), at least 0. With
  experts, S_none counts the expert FFN activations of the tokens routed to the rank as
  :class:`~pipewright.cost.moe_cost.MoECost` stores them. The backward's own gradient buffers are
  not priced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import cache
from types import MappingProxyType
from typing import Any, ClassVar

from pipewright.cost.chunk_memory import output_kept_bytes, stored_memory_bytes
from pipewright.cost.placement import roles
from pipewright.cost.transformer import TransformerCost, _Chunk
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F, I, Schedule, W

RECOMPUTE_METHODS = ("uniform", "block")
_KINDS = (F, B, I, W)


def check_partial(method: str | None, num_layers: int | None, recompute: str) -> None:
    """One-line errors: an unknown method, N < 1, or either option without ``--recompute full``."""
    if method is None and num_layers is None:
        return
    if recompute != "full":
        raise ConfigError(
            "--recompute-method and --recompute-num-layers apply to --recompute full "
            f"(Megatron-LM's --recompute-granularity full); got --recompute {recompute}"
        )
    if method is None:
        raise ConfigError("--recompute-num-layers needs --recompute-method uniform or block")
    if method not in RECOMPUTE_METHODS:
        names = ", ".join(RECOMPUTE_METHODS)
        raise ConfigError(f"--recompute-method must be one of {names} (got {method!r})")
    if num_layers is not None and num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be at least 1 (got {num_layers})")


def recompute_groups(method: str, num_layers: int, n: int) -> tuple[tuple[int, int], ...]:
    """The checkpoints of a chunk of ``n`` layers as [a, b) layer ranges, first to last (module
    docstring): ``uniform`` groups of ``num_layers`` (the last cut at n), ``block`` single layers
    0 … min(N, n) − 1."""
    if method == "block":
        return tuple((j, j + 1) for j in range(min(num_layers, n)))
    return tuple((a, min(a + num_layers, n)) for a in range(0, n, num_layers))


def _plus(a: Mapping[str, Any], b: Mapping[str, Any], c: Mapping[str, Any]) -> dict[str, Any]:
    """a + b − c per kind: numbers add; tuples (GEMM shapes, collective sizes) as multisets."""
    out: dict[str, Any] = {}
    for kind in a:
        x, y, z = a[kind], b.get(kind, ()), c.get(kind, ())
        if isinstance(x, tuple):
            count = Counter(x)
            count.update(y)
            count.subtract(z)
            out[kind] = _multiset(count)
        else:
            out[kind] = x + (y or 0.0) - (z or 0.0)
    return out


def _multiset(count: Counter) -> tuple:
    """A multiset back as a tuple; GEMM entries (m, n, k, count) with counts merged per shape."""
    items = [x for x, c in count.items() for _ in range(max(c, 0))]
    if not items or not isinstance(items[0], tuple):
        return tuple(items)
    shapes: Counter = Counter()
    for m, nn, k, cnt in items:
        shapes[(m, nn, k)] += cnt
    return tuple((*shape, cnt) for shape, cnt in shapes.items() if cnt)


@dataclass(frozen=True, eq=False)
class PartialRecomputeCost(TransformerCost):
    """Megatron-LM's ``--recompute-method`` (``uniform``/``block``) with ``--recompute-num-layers``
    (module docstring). A mixin: :func:`partial_class` composes it with the spec's cost class, whose
    one-mode models (``recompute`` none and full) price each part."""

    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    #: the class the one-mode models are (:func:`partial_class` sets it; not a field)
    one_mode: ClassVar[type[TransformerCost]] = TransformerCost

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", "full")
        check_partial(self.recompute_method, self.recompute_num_layers, "full")
        super().__post_init__()

    def mode_model(self, mode: str) -> TransformerCost:
        """The one-mode model (same fields, ``recompute=mode``), cached."""
        key = ("partial-mode", mode)
        model = self._cache.get(key)
        if model is None:
            skip = ("recompute", "recompute_method", "recompute_num_layers")
            kw = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name not in skip}
            model = self._cache[key] = self.one_mode(recompute=mode, **kw)
        return model

    def prefix(self, mode: str, stage: int, layers: tuple[int, ...], j: int) -> _Chunk:
        """Mode ``mode``'s chunk ``stage`` holding only its first ``j`` layers (module docstring)."""
        key = ("partial-prefix", mode, stage, layers, j)
        hit = self._cache.get(key)
        if hit is None:
            cut = (*layers[:stage], j, *layers[stage + 1 :])
            hit = self._cache[key] = self.mode_model(mode)._build_chunk(stage, len(layers), cut)
        return hit

    def _check_layers(self, layers: tuple[int, ...]) -> None:
        most = max(layers, default=0)
        if self.recompute_num_layers > most:
            raise ConfigError(
                f"--recompute-num-layers {self.recompute_num_layers} exceeds the {most} layers of the "
                "largest pipeline chunk"
            )

    def _recomputed(self, n: int) -> int:
        return min(self.recompute_num_layers, n) if self.recompute_method == "block" else n

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        self._check_layers(layers)
        n = layers[stage]
        k = self._recomputed(n)
        full = self.prefix("full", stage, layers, n)
        if self.recompute_method == "uniform":
            saved = sum(self._stored("full", stage, layers, a, a + 1) for a, _ in self._groups(n))
            less = self._stored("full", stage, layers, 0, n) - saved
            memory = dict(full.memory)
            memory[F] -= less
            memory[B] += less
            memory[I] += less
            return _replace(full, memory=memory)
        none = self.prefix("none", stage, layers, n)
        if k == n:
            return full
        if k == 0:
            return none
        part, base = self.prefix("full", stage, layers, k), self.prefix("none", stage, layers, k)
        tables = ("flops", "model_flops", "tp_bytes", "traffic", "memory", "gemms", "attention")
        new = {name: _plus(getattr(none, name), getattr(part, name), getattr(base, name)) for name in tables}
        return _replace(none, **new)

    def _groups(self, n: int) -> tuple[tuple[int, int], ...]:
        return recompute_groups(self.recompute_method, self.recompute_num_layers, n)

    def _stored(self, mode: str, stage: int, layers: tuple[int, ...], a: int, b: int) -> float:
        """S_mode(a, b): what layers a … b − 1 of the chunk store under ``mode`` (module docstring)."""
        return self.prefix(mode, stage, layers, b).memory[F] - self.prefix(mode, stage, layers, a).memory[F]

    def _decomposed(self, action: Action, schedule: Schedule, of: Callable[[Any, _Chunk], float]) -> float:
        """``of(model, chunk)`` of the action's chunk as the parts price it (module docstring)."""
        layers = self.layers_of(schedule)
        self._check_layers(layers)
        stage = action.stage
        n = layers[stage]
        k = self._recomputed(n)
        full, none = self.mode_model("full"), self.mode_model("none")
        if k == n:
            return of(full, self.prefix("full", stage, layers, n))
        value = of(none, self.prefix("none", stage, layers, n))
        if k:
            value += of(full, self.prefix("full", stage, layers, k)) - of(
                none, self.prefix("none", stage, layers, k)
            )
        return value

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        """The action's seconds as its parts' one-mode models price them (module docstring)."""
        kind = action.kind
        if kind not in _KINDS or not schedule.kinds[kind].compute:
            return super().compute_time(action, schedule)
        rank = schedule.rank_of(action.stage)
        key = ("partial-time", action.stage, kind, schedule.num_stages, rank)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._decomposed(
                action, schedule, lambda model, chunk: model.kind_time(chunk, kind, rank)
            )
        return hit

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """The recomputation transient of the action's B or I (module docstring); 0 otherwise."""
        if action.kind not in (B, I):
            return 0.0
        layers = self.layers_of(schedule)
        self._check_layers(layers)
        stage, kind = action.stage, action.kind
        n = layers[stage]
        if not n:
            return 0.0
        freed = (
            output_kept_bytes(self.cost_inputs) if roles(self.layout, stage, schedule.num_stages)[1] else 0.0
        )
        groups = self._groups(n)
        k = groups[-1][1]
        if k < n:  # block: the unrecomputed layers' backward runs first and frees what they stored
            freed -= self.prefix("none", stage, layers, n).memory[kind]
            freed += self.prefix("none", stage, layers, k).memory[kind]
        peak = 0.0
        for a, b in reversed(groups):
            kept = self._stored("full", stage, layers, a, a + 1)
            peak = max(peak, self._stored("none", stage, layers, a, b) - kept - freed)
            freed += kept
        return peak

    def layer_transient(self) -> float:
        """One checkpoint's re-created bytes for the planner's estimate: one layer's under ``block``;
        under ``uniform`` a group of N layers', N·(stored without recomputation) − the group's input
        (the one-mode full model's layer transient + N − 1 layers' stored bytes)."""
        one = self.mode_model("full").layer_transient()
        if self.recompute_method == "block":
            return one
        layer = one + stored_memory_bytes(self.cost_inputs, "full") / self.cp
        return one + (self.recompute_num_layers - 1) * layer


def _exposed_comm(self: PartialRecomputeCost, action: Action, schedule: Schedule) -> float:
    """The communication the parts' models expose inside the action (a class that prices one:
    :meth:`~pipewright.cost.moe_cost.MoECost.a2a_time`)."""
    if action.kind not in _KINDS:
        return 0.0
    rank = schedule.rank_of(action.stage)
    return self._decomposed(action, schedule, lambda model, chunk: model.a2a_time(chunk, action.kind, rank))


def _replace(chunk: _Chunk, **tables: Mapping[str, Any]) -> _Chunk:
    from dataclasses import replace

    return replace(chunk, **{k: MappingProxyType(v) for k, v in tables.items()})


@cache
def partial_class(cls: type[TransformerCost]) -> type[TransformerCost]:
    """``cls`` with :class:`PartialRecomputeCost` in front (one class per ``cls``, kept as an
    attribute of this module so that it pickles by name)."""
    if issubclass(cls, PartialRecomputeCost):
        return cls
    name = f"Partial{cls.__name__}"
    body: dict[str, object] = {"__module__": __name__, "__doc__": PartialRecomputeCost.__doc__}
    body["one_mode"] = cls
    if hasattr(cls, "a2a_time"):
        body["exposed_comm"] = _exposed_comm
    made = dataclass(frozen=True, eq=False)(type(name, (PartialRecomputeCost, cls), body))
    globals()[name] = made
    return made
