"""Measured rates of the layer shapes a sweep ran: what ``pipewright calibrate`` learns per shape.

The cost model prices a pass from its mechanisms (GEMMs by shape, memory-bound bytes, collectives,
the host's launches; :mod:`pipewright.cost.dispatch`) under a framework's fitted constants c and δ.
What those leave unexplained for one shape — cuBLAS's kernel choice for that GEMM shape, the host's
path through that framework's code at that size — is a property of the shape, not of the layout: the
same layer at the same microbatch and tensor-parallel size runs alike whatever the pipeline depth,
the data-parallel size or the number of layers. A sweep measures each shape under many layouts, so
its runs pin that down, as a GPU profile of the layer would (vTrain, Bang et al. MICRO'24, profiles
each (hidden, tp, microbatch) on the GPU; a sweep's end-to-end times hold the same information).

For each :class:`Shape` measured in at least :data:`MIN_ROWS` fit runs, ``calibrate`` fits two
factors (:class:`ShapeScale`): ``layers`` multiplies each pass of the transformer layers, ``ends``
each pass of the embedding and the output layer with its loss (:func:`pipewright.cost.dispatch.
chunk_launched`, the planner's pieces in :mod:`pipewright.plan.costs`). Their ratio is identified
by runs whose stages hold different numbers of layers per embedding or head (pipeline depth, layer
count). A shape the sweep did not measure is priced by the mechanisms alone (factors 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipewright.errors import ConfigError

#: the fewest fit runs of one shape its factors are fitted on (no constant from a single run)
MIN_ROWS = 3


@dataclass(frozen=True)
class Shape:
    """What decides a layer's kernels: the model's layer, its split and the precision and options that
    change the kernels run."""

    family: str
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    seq_len: int
    vocab: int
    tp: int
    cp: int
    microbatch: int
    dtype: str
    recompute: str
    attention: str
    sequence_parallel: bool


@dataclass(frozen=True)
class ShapeScale:
    """Measured over priced seconds of a shape's layer passes (``layers``) and of its embedding and
    head passes (``ends``), fitted on ``rows`` measured runs."""

    layers: float
    ends: float
    rows: int


def shape_of(cost: Any) -> Shape:
    """The :class:`Shape` a :class:`~pipewright.cost.transformer.TransformerCost` prices."""
    spec = cost.spec
    return Shape(
        spec.family,
        spec.hidden,
        spec.heads,
        spec.kv_heads or spec.heads,
        spec.ffn_hidden,
        spec.seq_len,
        spec.vocab,
        cost.mesh.tp,
        cost.cp,
        cost.microbatch,
        cost.dtype,
        cost.recompute,
        cost.attention,
        bool(cost.sequence_parallel and cost.mesh.tp > 1),
    )


def scales_of(cost: Any) -> tuple[float, float]:
    """(layers, ends) factors of ``cost``'s shape in its calibration; (1, 1) without one."""
    shapes = getattr(getattr(cost, "calibration", None), "shapes", None)
    if not shapes:
        return 1.0, 1.0
    hit = shapes.get(shape_of(cost))
    return (hit.layers, hit.ends) if hit is not None else (1.0, 1.0)


def shapes_json(shapes: Mapping[Shape, ShapeScale]) -> list[dict[str, object]]:
    """The calibration file's ``shapes`` list: each shape's fields with its factors and run count."""
    out = []
    for shape, scale in shapes.items():
        out.append({**asdict(shape), "layers": round(scale.layers, 6), "ends": round(scale.ends, 6),
                    "rows": scale.rows})  # fmt: skip
    return out


def parse_shapes(items: object, where: str) -> dict[Shape, ShapeScale]:
    """The ``shapes`` list of a calibration file; a one-line ConfigError naming the entry and field."""
    if items is None:
        return {}
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise ConfigError(f"{where}: 'shapes' must be a list")
    out: dict[Shape, ShapeScale] = {}
    for i, item in enumerate(items):
        at = f"{where}: shapes[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at} is not an object")
        values = {}
        for f in fields(Shape):
            value = item.get(f.name)
            kind = {"str": str, "int": int, "bool": bool}[str(f.type)]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"{at}: {f.name!r} must be {f.type!s} (got {value!r})")
            if kind is int and value < 1:
                raise ConfigError(f"{at}: {f.name!r} must be at least 1 (got {value})")
            values[f.name] = value
        factors = []
        for key in ("layers", "ends"):
            value = item.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"{at}: {key!r} must be a positive number (got {value!r})")
            factors.append(float(value))
        rows = item.get("rows", 0)
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ConfigError(f"{at}: 'rows' must be a count (got {rows!r})")
        out[Shape(**values)] = ShapeScale(*factors, rows)
    return out
