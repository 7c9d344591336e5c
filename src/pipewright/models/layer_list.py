"""Any model as a list of layers: the stages of a model that is a sequence ``x ↦ fₙ(… f₁(f₀(x)))``.

The convention is DeepSpeed's ``PipelineModule``: a model is a list whose entries are ``nn.Module``
instances or *factories* (callables that build one, so that a stage builds only its own layers), and a
:class:`Tied` entry names a module shared by several positions (DeepSpeed's ``TiedLayerSpec``): each
pipeline rank holding one of them keeps its own copy, and after the backward the copies' gradients are
summed over those ranks (:mod:`pipewright.runtime.parallel.tied` does the same for the input embedding and the
output layer), so every copy sees ∂L/∂θ = Σ over positions, the shared module's gradient, and the
identical optimizer steps keep the copies equal.

Partitions (which contiguous run of layers each of the pp × virtual stages holds):

- ``"uniform"``: ⌊n/S⌋ layers each, the first n mod S stages one more
  (:func:`~pipewright.models.layout.uniform_layer_counts`, the transformers' rule);
- ``"parameters"``: contiguous runs minimising the largest stage's parameter count (exact, by dynamic
  programming over the prefix sums);
- a ``pipewright profile`` table (a CSV or JSON path) or a sequence of per-layer costs: the same
  minimisation over each layer's measured F + B time (a row's ``layer_type`` is the layer's index, else
  its class name);
- a layout string (``"t*3|t*2"``, Megatron's notation; ``E`` and ``L`` are read as nothing), a
  ``pipewright plan`` JSON file (its layout), or a sequence of layer counts per stage.

Layer i's initial weights come from seed ``seed·1000003 + i`` whatever the stage holding it (a tied
module: the seed of its first position), so every layout starts from the same model. When the schedule
splits the backward (ZB-H1 and the other I/W schedules) the stages' ``nn.Linear`` layers become
:class:`~pipewright.models.wgrad.DeferrableLinear` (same parameters): their weight gradients wait for W.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.layout import Layout, StageLayout, parse_layout, uniform_layer_counts
from pipewright.models.wgrad import DeferrableLinear, default_linear_factory

#: ``loss_fn(output, target) -> scalar``: the mean loss of one microbatch.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``data(split, step, rows) -> (inputs, targets)``: global batch ``step`` of ``split`` ("train" or
#: "val"), ``rows`` rows, the same whatever the layout.
DataFn = Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Tied:
    """A module shared by every position that names the same ``key`` (built by ``layer``, a module or
    a factory, at the first of them). ``forward(module, x)``: how this position uses it (default
    ``module(x)``; e.g. ``lambda emb, h: h @ emb.weight.T`` for an output layer tied to an embedding)."""

    key: str
    layer: Any
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


def _build(entry: Any, seed: int, where: str) -> nn.Module:
    """The module of one list entry: a module itself, or its factory called under ``seed``."""
    if isinstance(entry, nn.Module):
        return entry
    if not callable(entry):
        raise ConfigError(f"{where}: {type(entry).__name__} is neither an nn.Module nor a factory")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = entry()
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{where}: its factory returned {type(module).__name__}, not an nn.Module")
    return module


def _as_deferrable(module: nn.Module) -> nn.Module:
    """Every plain ``nn.Linear`` inside ``module`` turned into a DeferrableLinear (same parameters and
    state-dict keys; its backward can hand the weight gradient to a W pass)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = DeferrableLinear
            m._defer = (None, None)
    return module


class LayerStage(nn.Module):
    """One stage: the layers at positions ``indices`` applied in order. Own layers are
    ``layers.<i>`` (so parameter names are global and ``--recompute full`` checkpoints each layer), a
    tied module is ``tied.<key>`` (one object per rank, one name on every rank)."""

    def __init__(
        self,
        order: Sequence[tuple[str, str | None, Callable | None]],
        own: dict[str, nn.Module],
        tied: dict[str, nn.Module],
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(own)
        self.tied = nn.ModuleDict(tied)
        self.order = list(order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = next(self.parameters(), None)
        if p is not None and x.is_floating_point() and x.dtype != p.dtype:
            x = x.to(p.dtype)  # --precision bf16/fp16: the stage-0 input in the compute dtype
        for name, key, fn in self.order:
            if key is None:
                x = self.layers[name](x)
            else:
                module = self.tied[key]
                x = fn(module, x) if fn is not None else module(x)
        return x


class LayerList:
    """A model given as a list of layers (see the module docstring), with its loss and data.

    Picklable when its entries, ``loss_fn`` and ``data`` are (module-level functions and classes):
    the worker processes receive it."""

    def __init__(
        self,
        layers: Sequence[Any],
        loss_fn: LossFn,
        data: DataFn,
        partition: Any = "uniform",
        name: str = "layer-list",
    ) -> None:
        if not layers:
            raise ConfigError("pipeline: the layer list is empty; give at least one layer")
        if not callable(loss_fn):
            raise ConfigError("pipeline: loss_fn must be callable as loss_fn(output, target)")
        if not callable(data):
            raise ConfigError("pipeline: data must be callable as data(split, step, rows)")
        self.entries = list(layers)
        self.loss_fn, self.data, self.partition, self.name = loss_fn, data, partition, name
        self.first_of: dict[str, int] = {}
        for i, entry in enumerate(self.entries):
            if isinstance(entry, Tied):
                self.first_of.setdefault(entry.key, i)

    def __len__(self) -> int:
        return len(self.entries)

    def layer_seed(self, seed: int, index: int) -> int:
        return seed * 1000003 + index

    def _module(self, index: int, seed: int) -> nn.Module:
        entry = self.entries[index]
        if isinstance(entry, Tied):
            first = self.first_of[entry.key]
            return _build(self.entries[first].layer, self.layer_seed(seed, first), f"layer {first}")
        return _build(entry, self.layer_seed(seed, index), f"layer {index}")

    # -- partitions --------------------------------------------------------------------------------

    def layout(self, num_stages: int) -> Layout:
        """The partition as a :class:`~pipewright.models.layout.Layout` of ``num_stages`` stages (the
        loss on the last); one-line ConfigError when it does not fit."""
        counts = self.stage_counts(num_stages)
        stages, start = [], 0
        for s, n in enumerate(counts):
            stages.append(StageLayout(s == 0, tuple(range(start, start + n)), s == num_stages - 1))
            start += n
        return Layout(tuple(stages))

    def stage_counts(self, num_stages: int) -> tuple[int, ...]:
        n, part = len(self), self.partition
        if num_stages > n:
            raise ConfigError(
                f"{num_stages} pipeline stages (pp × virtual) but only {n} layers; lower --pp/--virtual"
            )
        if part is None or part == "uniform":
            return uniform_layer_counts(n, num_stages)
        if part == "parameters":
            return balanced_counts(self.parameter_counts(), num_stages)
        if isinstance(part, str | Path) and Path(part).suffix.lower() in (".csv", ".json"):
            path = Path(part)
            if not path.is_file():
                raise ConfigError(f"partition: {path} does not exist; give a profile table or plan file")
            if _is_plan(path):  # a `pipewright plan` file: its "layout"
                return _checked(_layout_counts(json.loads(path.read_text())["layout"]), n, num_stages)
            return balanced_counts(self.profile_costs(path), num_stages)
        if isinstance(part, str):
            return _checked(_layout_counts(part), n, num_stages)
        values = list(part)
        if all(isinstance(v, int) for v in values) and len(values) == num_stages and sum(values) == n:
            return tuple(values)
        if len(values) == n and all(isinstance(v, int | float) for v in values):
            return balanced_counts([float(v) for v in values], num_stages)
        raise ConfigError(
            f"partition {part!r}: give 'uniform', 'parameters', a layout string, a profile or plan file, "
            f"{num_stages} layer counts summing to {n}, or {n} per-layer costs"
        )

    def parameter_counts(self) -> list[float]:
        """Parameters per position (a tied module counted at its first position), built on the meta
        device (no memory)."""
        out = []
        for i, entry in enumerate(self.entries):
            if isinstance(entry, Tied) and self.first_of[entry.key] != i:
                out.append(0.0)
                continue
            with torch.device("meta"):
                module = self._module(i, 0)
            out.append(float(sum(p.numel() for p in module.parameters())))
        return out

    def profile_costs(self, path: Path) -> list[float]:
        """Each layer's F + B seconds (or F + I + W) from a table in ``pipewright profile``'s format
        (CSV or JSON rows of layer_type, microbatch_size, kind, seconds): rows whose ``layer_type`` is
        the layer's index, else its class or factory name, else ``layer`` (a transformer profile)."""
        times: dict[str, float] = {}
        rows = _profile_rows(path)
        split = {r["layer_type"] for r in rows if r["kind"] in ("I", "W")}
        for r in rows:
            kind, name = r["kind"], r["layer_type"]
            if kind in ("F", "I", "W") or (kind == "B" and name not in split):
                times[name] = times.get(name, 0.0) + float(r.get("seconds") or 0.0)
        costs = []
        for i, entry in enumerate(self.entries):
            layer = entry.layer if isinstance(entry, Tied) else entry
            names = (str(i), getattr(layer, "__qualname__", None) or type(layer).__name__, "layer")
            found = next((times[k] for k in names if k in times), None)
            if found is None:
                raise ConfigError(f"profile {path}: no F/B rows for layer {i} (layer_type {names[0]!r})")
            costs.append(found)
        return costs

    # -- stages --------------------------------------------------------------------------------

    def build_stage(
        self, layout: Layout, stage_index: int, *, seed: int = 0, linear_factory=None
    ) -> nn.Module:
        """Stage ``stage_index`` of ``layout``: only its layers are built (tied ones once per call)."""
        indices = layout.stages[stage_index].layers
        own, tied, order = {}, {}, []
        for i in indices:
            entry = self.entries[i]
            if isinstance(entry, Tied):
                if entry.key not in tied:
                    tied[entry.key] = self._module(i, seed)
                order.append((str(i), entry.key, entry.forward))
            else:
                own[str(i)] = self._module(i, seed)
                order.append((str(i), None, None))
        stage = LayerStage(order, own, tied)
        return _as_deferrable(stage) if linear_factory is default_linear_factory else stage

    def share_tied(self, stages: dict[int, nn.Module]) -> None:
        """One module object per tied key on this rank, whatever the number of its stages holding it."""
        seen: dict[str, nn.Module] = {}
        for s in sorted(stages):
            for key in list(stages[s].tied):
                if key in seen:
                    stages[s].tied[key] = seen[key]
                else:
                    seen[key] = stages[s].tied[key]

    def tied_stages(self, layout: Layout) -> dict[str, tuple[int, ...]]:
        """Tied key → the stages holding one of its positions."""
        out: dict[str, list[int]] = {}
        for s, st in enumerate(layout.stages):
            for i in st.layers:
                entry = self.entries[i]
                if isinstance(entry, Tied) and s not in out.setdefault(entry.key, []):
                    out[entry.key].append(s)
        return {k: tuple(v) for k, v in out.items()}

    def boundary_shapes(self, layout: Layout, microbatch_size: int) -> dict[int, tuple[int, ...]]:
        """Stage s → the shape of one microbatch entering it (s ≥ 1), found by a forward of the whole
        list on the meta device (no memory, no compute)."""
        x, _ = self.data("train", 0, microbatch_size)
        shapes: dict[int, tuple[int, ...]] = {}
        tied: dict[str, nn.Module] = {}
        h = torch.empty(x.shape, dtype=x.dtype, device="meta")
        starts = {st.layers[0]: s for s, st in enumerate(layout.stages) if st.layers}
        for i, entry in enumerate(self.entries):
            if i in starts and starts[i] > 0:
                shapes[starts[i]] = tuple(h.shape)
            with torch.device("meta"):
                if isinstance(entry, Tied):
                    module = tied.setdefault(entry.key, _meta(self._module(i, 0)))
                    h = entry.forward(module, h) if entry.forward is not None else module(h)
                else:
                    h = _meta(self._module(i, 0))(h)
        return shapes

    def batch(self, split: str, step: int, rows: int, seq_len: int, seed: int) -> tuple[Any, Any]:
        """The trainer's dataset interface (``TokenDataset.batch``): the global batch as arrays."""
        x, y = self.data(split, step, rows)
        return _numpy(x), _numpy(y)

    def full(self, seed: int = 0) -> nn.Module:
        """The whole model as one stage (the single-process reference)."""
        whole = Layout((StageLayout(True, tuple(range(len(self))), True),))
        return self.build_stage(whole, 0, seed=seed)


def _meta(module: nn.Module) -> nn.Module:
    return module if all(p.is_meta for p in module.parameters()) else copy.deepcopy(module).to("meta")


def _numpy(t: Any) -> Any:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t


def _profile_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a profile table (CSV with ``#`` comment lines, or the JSON form's ``rows``)."""
    import csv

    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            rows = list(json.loads(text)["rows"])
        else:
            lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
            rows = list(csv.DictReader(lines))
        return [{**r, "layer_type": str(r["layer_type"]), "kind": str(r["kind"])} for r in rows]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"profile {path}: not a profile table ({exc})") from None


def _is_plan(path: Path) -> bool:
    if path.suffix.lower() != ".json":
        return False
    try:
        return "layout" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def _layout_counts(text: str) -> tuple[int, ...]:
    """Layers per stage of a layout string; ``E``/``L`` are optional (Megatron plans carry them)."""
    parts = text.replace(" ", "").split("|")
    fixed = "|".join(("E" if i == 0 else "") + p.strip("EL") + ("L" if i == len(parts) - 1 else "")
                     for i, p in enumerate(parts))  # fmt: skip
    return tuple(len(s.layers) for s in parse_layout(fixed).stages)


def _checked(counts: tuple[int, ...], n: int, num_stages: int) -> tuple[int, ...]:
    text = "|".join(f"t*{c}" for c in counts)
    if sum(counts) != n:
        raise ConfigError(f"partition {text} holds {sum(counts)} layers but the list has {n}")
    if len(counts) != num_stages:
        raise ConfigError(f"partition {text} has {len(counts)} stages but pp × virtual = {num_stages}")
    if min(counts) < 1:
        raise ConfigError(f"partition {text}: every stage needs a layer")
    return counts


def balanced_counts(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous runs of ``costs`` over ``num_stages`` stages (at least one layer each) minimising the
    largest run's sum: best[s][j] = min over i of max(best[s−1][i], cost[i:j]) (the linear-partition
    dynamic programme, O(S·n²))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return tuple(reversed(counts))
