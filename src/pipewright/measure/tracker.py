"""What one rank's program does, op by op, on meta tensors: live bytes by category, FLOPs and
communicated bytes per action.

:class:`ProgramTracker` is a ``TorchDispatchMode`` over meta tensors (:mod:`.fake`); every aten and
c10d op of the rank passes through it:

- **memory**: each new tensor storage is counted from its creation to its release (a weak reference
  to the storage, as ``torch.distributed._tools.mem_tracker.MemTracker`` keeps one), in the category
  of the phase that made it (``activations`` while the schedule runs, ``optimizer`` during the
  optimizer step); storages are moved to ``params``/``buffers``/``optimizer`` after the build
  (:func:`pipewright.measure.rank.measure_rank`) and to ``grads`` when autograd accumulates them into a
  parameter's ``.grad``. The peak is the highest sum of live bytes, with its split and the action
  running when it was reached.
- **FLOPs**: ``torch.utils.flop_counter``'s formulas (matrix products and attention; the CPU flash
  attention kernels priced as the GPU ones), summed per action kind.
- **bytes**: every ``c10d`` op's payload — a send's or receive's tensor, an all-reduce's tensor, an
  all-gather's output, a reduce-scatter's input, an all-to-all's input — per (op, group) and per
  action kind (an all-to-all of integers, the routing's tokens per expert, as ``all_to_all_counts``).
- **values read**: a meta tensor has no data, so ``.item()`` (a loss, a gradient norm, a finite
  check) reads 1.0 for floating point, 1 for integers and True for booleans (every check passes);
  a mixture of experts' routing counts read balanced routing's (:mod:`.routing`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from pipewright.measure.routing import RoutedValues

aten = torch.ops.aten

#: memory categories, in report order
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "other")

#: in-place products priced as their out-of-place forms (``W.grad += gᵀx`` as one ``addmm_``); and
#: the CPU flash-attention kernels (what ``F.scaled_dot_product_attention`` runs on CPU tensors),
#: priced like the GPU flash kernels: 4·b·h·s_q·s_k·d forward (QKᵀ and PV), twice that backward
#: (``torch.utils.flop_counter``'s ``sdpa_flop`` / ``sdpa_backward_flop``; masks not counted)
_FLOPS = {
    **flop_registry,
    aten.addmm_: flop_registry[aten.addmm],
    aten.baddbmm_: flop_registry[aten.baddbmm],
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}

_SCALAR = aten._local_scalar_dense.default
_TO_COPY = aten._to_copy.default
_c10d = torch.ops.c10d
#: c10d op → (report name, which argument's bytes: "in"/"out" tensor lists)
_COMM = {
    _c10d.send.default: ("send", 0),
    _c10d.recv_.default: ("recv", 0),
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.allgather_.default: ("all_gather", 0),
    _c10d._allgather_base_.default: ("all_gather", 0),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
    _c10d.alltoall_.default: ("all_to_all", 1),
    _c10d.broadcast_.default: ("broadcast", 0),
}


def _nbytes(obj: Any) -> int:
    tensors = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _integral(obj: Any) -> bool:
    tensors = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(t.dtype.is_floating_point for t in tensors)


def _to_host(t: torch.Tensor, device: Any) -> bool:
    return device is not None and t.device.type == "meta" and torch.device(device).type != "meta"


def _group(args: Iterable[Any]) -> Any:
    return next((a for a in args if isinstance(a, torch.ScriptObject)), None)


class ProgramTracker(TorchDispatchMode):
    """Live bytes, FLOPs and communicated bytes of the ops run under it (module docstring).

    ``action``: the label of the action running (set by the executor wrapper); ``phase``: the
    category new storages are counted in. ``group_names``: a process group's name → a label
    (``tp``, ``dp``, ``pp``, …) for the byte counts."""

    def __init__(self, group_names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.group_names = dict(group_names or {})
        self.phase = "other"
        self.action = "build"
        self.kind = "build"
        self.counting = True  # FLOPs and bytes (memory is always tracked)
        self._live: dict[int, list] = {}  # storage key → [bytes, category, weakref]
        self.totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.live = 0
        self.peak = 0
        self.peak_parts: dict[str, int] = dict(self.totals)
        self.peak_action = ""
        self.flops: dict[str, int] = defaultdict(int)
        self.comm: dict[tuple[str, str], int] = defaultdict(int)  # (op, group) → bytes
        self.comm_by_kind: dict[tuple[str, str], int] = defaultdict(int)  # (kind, op) → bytes
        self.comm_count: dict[tuple[str, str], int] = defaultdict(int)
        self.routed = RoutedValues()

    # -- memory ----------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        size = st.nbytes()
        entry = [size, self.phase, None]
        entry[2] = weakref.ref(st, lambda _, key=key: self._release(key))
        self._live[key] = entry
        self.totals[self.phase] += size
        self.live += size
        if self.live > self.peak:
            self.peak, self.peak_parts, self.peak_action = self.live, dict(self.totals), self.action

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.totals[entry[1]] -= entry[0]
            self.live -= entry[0]

    def move(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count the storages of ``tensors`` (tracked or not yet) in ``category`` from now on."""
        phase = self.phase
        self.phase = category
        try:
            for t in tensors:
                entry = self._live.get(t.untyped_storage()._cdata)
                if entry is None:
                    self._add(t)
                elif entry[1] != category:
                    self.totals[entry[1]] -= entry[0]
                    self.totals[category] += entry[0]
                    entry[1] = category
        finally:
            self.phase = phase

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (and clear the FLOP and byte counts)."""
        self.peak, self.peak_parts, self.peak_action = self.live, dict(self.totals), self.action
        self.flops.clear()
        self.comm.clear()
        self.comm_by_kind.clear()
        self.comm_count.clear()

    # -- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = self.routed.value(args[0]) if args else None
        if func is _SCALAR:
            if known is not None:
                return known.item()
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        if func is _TO_COPY and _to_host(args[0], kwargs.get("device")):  # a value read back: ones
            if known is not None:
                return known.to(kwargs.get("dtype") or known.dtype)
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
        answered, out = self.routed.handle(func, args, kwargs)
        if not answered:
            out = func(*args, **kwargs)
        self.routed.follow(func, args, kwargs, out)
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._add(t)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._add(u)
        if self.counting:
            formula = _FLOPS.get(func._overloadpacket)
            if formula is not None:
                self.flops[self.kind] += int(formula(*args, **kwargs, out_val=out))
            elif func in _COMM:
                self._count_comm(func, args)
        return out

    def _count_comm(self, func, args) -> None:
        name, which = _COMM[func]
        group = _group(args)
        name_ = torch._C._distributed_c10d.ProcessGroup.unbox(group).group_name if group is not None else ""
        label = self.group_names.get(name_, "?")
        size = _nbytes(args[which])
        if name == "all_to_all" and _integral(args[which]):  # the routing's tokens per expert
            name = "all_to_all_counts"
        self.comm[(name, label)] += size
        self.comm_by_kind[(self.kind, name)] += size
        self.comm_count[(name, label)] += 1
