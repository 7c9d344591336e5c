"""Resuming a checkpoint at another tensor-parallel size.

Pipeline and data parallelism need nothing here: checkpoint keys are global parameter names, and
torch.distributed.checkpoint reads each rank's tensors from whatever files the saving layout wrote.
Tensor-parallel shards are stored under per-rank keys, ``model/<name>#tp<r>of<t>`` (and
``optim/<name>#tp<r>of<t>/<slot>``), so a key the loading layout needs may be absent: the shards of
another t, or the full tensor of t = 1. :func:`reshard_plan` then reads every stored piece of that
parameter (DCP, into temporary tensors sized from the checkpoint's metadata), joins them into the full
tensor and cuts out this rank's piece. How a parameter is split — dimension and fused blocks (QKV: 3
blocks, each split over t: Megatron-LM's layout) — is recorded in ``meta.json`` (``tp_shards``) by the
saving run (:func:`shard_layout`)::

    shard r of t = concat over blocks j of chunk r (of t) of block j, along dim
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

_SUFFIX = re.compile(r"^(?P<base>.*)#tp(?P<r>\d+)of(?P<t>\d+)$")


def shard_layout(modules: Iterable[nn.Module], sharded: set[int]) -> dict[str, list[int]]:
    """{parameter name: [split dim, fused blocks]} of the parameters whose ``id`` is in ``sharded``
    (column-parallel weights/biases: dim 0; row-parallel weights: dim 1; vocabulary tables: dim 0)."""
    out: dict[str, list[int]] = {}
    for module in modules:
        for prefix, m in module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in sharded:
                    dim = int(getattr(m, "weight_dim", 0)) if pname == "weight" else 0
                    out[f"{prefix}.{pname}" if prefix else pname] = [dim, int(getattr(m, "blocks", 1))]
    return out


def _split_key(key: str) -> tuple[str, str, str, tuple[int, int] | None] | None:
    """ "model/x#tp0of2" → ("model", "x", "", (0, 2)); "optim/x/exp_avg" → ("optim", "x", "exp_avg", None)."""
    head, _, rest = key.partition("/")
    if head == "model":
        name, slot = rest, ""
    elif head == "optim":
        name, _, slot = rest.rpartition("/")
    else:
        return None
    m = _SUFFIX.match(name)
    return (head, m["base"], slot, (int(m["r"]), int(m["t"]))) if m else (head, name, slot, None)


def _key(head: str, base: str, slot: str, shard: tuple[int, int] | None) -> str:
    name = base + (f"#tp{shard[0]}of{shard[1]}" if shard else "")
    return f"{head}/{name}" + (f"/{slot}" if slot else "")


def _cut(full: torch.Tensor, dim: int, blocks: int, r: int, t: int) -> torch.Tensor:
    return torch.cat([blk.chunk(t, dim)[r] for blk in full.chunk(blocks, dim)], dim)


def _join(parts: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    split = [p.chunk(blocks, dim) for p in parts]
    return torch.cat([torch.cat([s[j] for s in split], dim) for j in range(blocks)], dim)


def reshard_plan(
    missing: Iterable[str], stored: Mapping[str, object], tp_shards: Mapping[str, list[int]]
) -> tuple[dict[str, torch.Tensor], Callable[[Mapping[str, torch.Tensor]], None], list[str]]:
    """For the needed keys absent from the checkpoint: (temporary tensors to load, keyed by stored key;
    ``fill(state)`` that writes each needed tensor from them after the load; the keys it cannot
    build). ``stored`` is DCP's ``state_dict_metadata``; ``tp_shards`` the saving run's layout."""
    temps: dict[str, torch.Tensor] = {}
    recipes: list[tuple[str, list[str], tuple[int, int] | None, list[int]]] = []
    unknown: list[str] = []
    for key in missing:
        parts = _split_key(key)
        if parts is None:
            unknown.append(key)
            continue
        head, base, slot, want = parts
        full_key = _key(head, base, slot, None)
        if full_key in stored:
            sources = [full_key]
        else:
            t = next(
                (
                    sp[3][1]
                    for k in stored
                    if (sp := _split_key(k)) and sp[:3] == (head, base, slot) and sp[3]
                ),
                0,
            )
            sources = [_key(head, base, slot, (r, t)) for r in range(t)]
            if not sources or any(s not in stored for s in sources) or base not in tp_shards:
                unknown.append(key)
                continue
        if want is not None and base not in tp_shards:
            unknown.append(key)
            continue
        for s in sources:
            if s not in temps:
                md = stored[s]
                temps[s] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        recipes.append((key, sources, want, tp_shards.get(base, [0, 1])))

    def fill(state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, sources, want, (dim, blocks) in recipes:
                pieces = [temps[s] for s in sources]
                full = pieces[0] if len(pieces) == 1 else _join(pieces, dim, blocks)
                piece = full if want is None else _cut(full, dim, blocks, *want)
                state[key].copy_(piece.to(state[key].device))

    return temps, fill, unknown
