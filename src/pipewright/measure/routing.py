"""Token routing on meta tensors: the values a mixture of experts reads, as balanced routing gives them.

A mixture of experts counts the tokens sent to each expert (``torch.bincount``) and reads the counts
back to split its tokens (``.tolist()``): the shapes that follow depend on values, which meta tensors
do not have (and ``bincount`` has no meta kernel). :class:`RoutedValues` gives those counts a value —
balanced routing, n assignments over E experts: ⌊n/E⌋ each and one more on the first n mod E, the
load the simulator prices — kept beside the meta tensor as a CPU tensor and carried through every op
whose tensor inputs all have one (a view, a sum, an index, a cast), so that a count read back is the
balanced one. Point-to-point and collective ops move no data on the fake process group; an
all-to-all's output takes its input's values (every rank routes alike, so each sends what it
receives).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_BINCOUNT = aten.bincount.default
_ALL_TO_ALL = {torch.ops.c10d.alltoall_base_.default}


def balanced_counts(assignments: int, experts: int) -> torch.Tensor:
    """[E] int64: ⌊n/E⌋ per expert and one more on the first n mod E."""
    counts = torch.full((experts,), assignments // experts, dtype=torch.long)
    counts[: assignments % experts] += 1
    return counts


class RoutedValues:
    """CPU values of the meta tensors that carry routing counts (module docstring)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(meta tensor) → (ref, value)

    def value(self, t: Any) -> torch.Tensor | None:
        """The value ``t`` carries, or None."""
        if not self._values or not isinstance(t, torch.Tensor):
            return None
        entry = self._values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        key = id(t)
        self._values[key] = (weakref.ref(t, lambda ref, key=key: self._forget(key, ref)), value)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if key in self._values and self._values[key][0] is ref:  # not a newer tensor at the same id
            del self._values[key]

    def handle(self, func, args, kwargs) -> tuple[bool, Any]:
        """(True, output) for an op answered here (``bincount`` on a meta tensor), else (False, None)."""
        if func is not _BINCOUNT or args[0].device.type != "meta" or args[0].dtype.is_floating_point:
            return False, None
        if (args[1] if len(args) > 1 else kwargs.get("weights")) is not None:
            return False, None
        minlength = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
        if minlength <= 0:
            return False, None
        out = torch.empty(minlength, dtype=torch.long, device="meta")
        self._set(out, balanced_counts(args[0].numel(), minlength))
        return True, out

    def follow(self, func, args, kwargs, out: Any) -> None:
        """Give ``out`` a value when every tensor input of ``func`` has one (an all-to-all: its input's)."""
        if func in _ALL_TO_ALL:
            value = self.value(args[1])
            if value is not None:
                self._set(args[0], value.clone())
            return
        if not self._values:
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors or any(self.value(t) is None for t in tensors):
            return
        host = tree_map(lambda t: self.value(t) if isinstance(t, torch.Tensor) else _host(t), (args, kwargs))
        result = func(*host[0], **host[1])
        pairs = zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=False)
        for meta, value in pairs:
            if isinstance(meta, torch.Tensor) and isinstance(value, torch.Tensor):
                self._set(meta, value)


def _host(x: Any) -> Any:
    """Device arguments (``_to_copy(device=meta)``) pointed at the CPU, where the values are."""
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x
