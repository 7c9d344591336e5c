"""fp32 master weights and optimizer state, optionally sharded over data parallelism (ZeRO-1).

:class:`MasterOptimizer` owns what the optimizer steps on:

- unsharded, fp32 model: the model's parameters themselves (the plain path);
- unsharded, bf16/fp16 model: one fp32 master copy per parameter, same names;
- sharded (ZeRO stage 1, Rajbhandari et al., SC20): this rank's parameters are laid end to end in two
  flat fp32 vectors (matrices, which get weight decay, and the rest), each padded to a multiple of d
  (the data-parallel size) and cut into d equal slices; dp rank r keeps only slice r as its master
  and keeps the optimizer state for that slice only — 1/d of the fp32 masters and of Adam's moments
  per rank.

The sharded step runs Megatron-LM's distributed-optimizer collectives: after the backward the local
gradients, laid out as the two flat vectors (padded, in the gradients' dtype or fp32 under
``--reduce-fp32``), are **reduce-scattered** over the dp group, so rank r receives only slice r summed
over the replicas; it divides by d and writes the average back into the slice-r part of the
parameters' ``.grad`` (the rest of ``.grad`` keeps this replica's own, unreduced values, as Megatron's
gradient buffer does); the step copies that part into the master's gradient, steps, and
**all-gathers** the d updated slices into every replica's parameters. Per element of the gradient
buffer that is (d−1)/d sent by the reduce-scatter plus (d−1)/d by the all-gather, against 2(d−1)/d for
an all-reduce plus (d−1)/d for the all-gather: 2/3 of the bytes, what ``cost/sharding.py`` prices. A
backend that lacks the reduce-scatter (``NotImplementedError``/``RuntimeError``) falls back, with one
log line, to an all-reduce of the flat buffer of which each rank keeps its slice. (PyTorch's gloo
backend, torch 2.13, itself runs ``reduce_scatter_tensor`` as an all-reduce of a copy of the buffer:
the byte saving is NCCL's.)

Element-wise optimizers (SGD with momentum, AdamW) give the same update on a slice as on the whole
tensor, so sharded and unsharded training agree to rounding. Gradient clipping uses the global norm
‖g‖ = √(Σ_r ‖g_slice r‖² summed over pp and tp as unsharded): each rank's squared norm of the
elements of its slice that count in the norm (tied copies and tp-replicated parameters counted once,
as :func:`~pipewright.optim.global_grad_norm` on the full gradients), all-reduced over dp (one
scalar), then over the tp and pp groups. The clipping factor, and under fp16 the 1/S loss-scale
factor, are applied while the slice is copied into the fp32 master gradients; fp16's overflow check
is that norm being finite (every rank agrees: it is all-reduced). The run guard's non-finite check
reads ``.grad``: a NaN/inf in any replica's local gradient reaches the reduced slice of its owner,
so the OR over ranks of "my slice or my local gradient is not finite" is "the reduced gradient is
not finite".

Checkpoints: :meth:`MasterOptimizer.named_state` names what to save — the masters under the
parameters' names when they are full copies; with sharding the model parameters plus each rank's
slices under ``zero.pp{p}.tp{t}.dp{r}of{d}.{decay|rest}`` (with their optimizer state), so a sharded
checkpoint resumes with the same dp, pp and tp.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from pipewright.optim import build_optimizer, global_grad_norm
from pipewright.runtime.reliability.timeouts import is_timeout, wait_or_raise

log = logging.getLogger(__name__)

#: backends whose reduce-scatter raised once: their gradients are all-reduced from then on
_NO_REDUCE_SCATTER: set[str] = set()


def reduce_scatter(out: torch.Tensor, buf: torch.Tensor, group, timeout_s: float | None = None) -> None:
    """``out`` ← slice r (``out``'s length, r = this rank in ``group``) of ``buf`` summed over the
    group: one reduce-scatter; where the backend lacks it, an all-reduce of ``buf`` (noted once).
    Waited at most ``timeout_s`` seconds
    (:class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout`)."""
    backend = str(dist.get_backend(group))
    if backend not in _NO_REDUCE_SCATTER:
        collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            work = collective(out, buf, group=group, async_op=True)
        except (NotImplementedError, RuntimeError) as exc:
            if is_timeout(exc):
                raise
            _NO_REDUCE_SCATTER.add(backend)
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            what = "%s has no reduce-scatter (%s); the sharded optimizer all-reduces the gradients"
            log.warning(what, backend, reason)
        else:
            _wait(work, timeout_s, buf.device, "reduce-scatter")
            return
    _wait(dist.all_reduce(buf, group=group, async_op=True), timeout_s, buf.device, "all-reduce")
    r, n = dist.get_rank(group), out.numel()
    out.copy_(buf[r * n : (r + 1) * n])


def _wait(work, timeout_s: float | None, device: torch.device, what: str) -> None:
    wait_or_raise(work, timeout_s, device, f"the data-parallel {what} of the gradients (sharded optimizer)")


def reduce_at_step(state, action) -> None:
    """REDUCE_GRAD handler under ZeRO-1: nothing to start here; the gradients are reduce-scattered
    once after the backward, in the optimizer's slice layout (:meth:`MasterOptimizer.reduce_grads`)."""


class _FlatShard:
    """One flat group of parameters and this rank's slice [lo, hi) of it."""

    def __init__(self, params: list[nn.Parameter], d: int, r: int, two_d: bool, device: torch.device) -> None:
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.size = -(-max(total, 1) // d)  # slice length (padded)
        self.lo, self.hi = r * self.size, (r + 1) * self.size
        flat = torch.zeros(self.size, dtype=torch.float32, device=params[0].device if params else device)
        self._copy(flat, [p.detach() for p in params])
        self.master = nn.Parameter(flat.view(1, -1) if two_d else flat)

    def _copy(self, out: torch.Tensor, tensors: list[torch.Tensor], factor: float = 1.0) -> None:
        """out (a slice-sized flat tensor) ← the [lo, hi) part of the concatenation of ``tensors``."""
        for t, off in zip(tensors, self.offsets, strict=True):
            a, b = max(off, self.lo), min(off + t.numel(), self.hi)
            if a < b:
                part = t.reshape(-1)[a - off : b - off].float()
                out[a - self.lo : b - self.lo].copy_(part * factor if factor != 1.0 else part)

    def set_grad(self, factor: float) -> None:
        grad = torch.zeros_like(self.master).view(-1)
        self._copy(grad, [_grad(p) for p in self.params], factor)
        self.master.grad = grad.view_as(self.master)

    def _overlaps(self, params: Sequence[nn.Parameter]):
        """(parameter, [a, b) within it, [a', b') within the slice) for each part of ``params`` in
        this rank's slice."""
        for p, off in zip(params, self.offsets, strict=True):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                yield p, (a - off, b - off), (a - self.lo, b - self.lo)

    def reduce_grads(self, group, dtype: torch.dtype | None, timeout_s: float | None = None) -> None:
        """Reduce-scatter the local gradients laid out as this flat vector (padded to d slices, in
        ``dtype``, default the gradients' own) over ``group``; write slice r's average into the
        slice-r part of the parameters' ``.grad``."""
        if not self.params:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        grads = [p.grad for p in self.params]
        if dtype is None:
            dtype = grads[0].dtype
            for g in grads[1:]:
                dtype = torch.promote_types(dtype, g.dtype)
        d = dist.get_world_size(group)
        buf = torch.zeros(d * self.size, dtype=dtype, device=grads[0].device)
        for g, off in zip(grads, self.offsets, strict=True):
            buf[off : off + g.numel()].copy_(g.reshape(-1))
        out = torch.empty(self.size, dtype=dtype, device=buf.device)
        reduce_scatter(out, buf, group, timeout_s)
        out /= d
        for p, (a, b), (i, j) in self._overlaps(self.params):
            p.grad.view(-1)[a:b].copy_(out[i:j])

    def slice_grads(self, counted: set[int]) -> list[torch.Tensor]:
        """Views of the slice-r parts of the gradients of the parameters whose id is in ``counted``."""
        return [p.grad.view(-1)[a:b] for p, (a, b), _ in self._overlaps(self.params) if id(p) in counted]

    def gather_grads(self, group) -> None:
        """All-gather the reduced slices into every parameter's ``.grad`` (the full average). An
        empty group (every dp peer holds the same stage, so the same empty group) is skipped."""
        if not self.params:
            return
        mine = torch.zeros(self.size, dtype=torch.float32, device=self.master.device)
        self._copy(mine, [_grad(p) for p in self.params])
        full = all_gather_flat(mine, group)
        for p, off in zip(self.params, self.offsets, strict=True):
            if p.grad is not None:
                p.grad.copy_(full[off : off + p.numel()].view_as(p))

    def gather_into_params(self, group) -> None:
        """All-gather the d slices into one flat buffer in the parameters' dtype and write it into the
        parameters: the slice is cast before the gather (the same rounding as casting after), so the
        transient is (d + 1)·slice elements of the parameter dtype — (d + 1)/d · 2 bytes per parameter
        under bf16 (3 at d = 2), against 8 for a list of fp32 slices and their concatenation. An
        empty group is skipped on every dp peer alike (they hold the same stage)."""
        if not self.params:
            return
        dtype = self.params[0].dtype
        for p in self.params[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        full = all_gather_flat(self.master.data.view(-1).to(dtype), group)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets, strict=True):
                p.copy_(full[off : off + p.numel()].view_as(p))


def all_gather_flat(mine: torch.Tensor, group) -> torch.Tensor:
    """The d ranks' ``mine`` (equal lengths) laid end to end in one new flat tensor of ``mine``'s dtype
    and device: one ``all_gather_into_tensor`` (NCCL's allgather into a single buffer; gloo has it
    too); a backend without it fills views of that buffer with ``all_gather`` (no concatenation)."""
    d = dist.get_world_size(group)
    full = torch.empty(d * mine.numel(), dtype=mine.dtype, device=mine.device)
    try:
        dist.all_gather_into_tensor(full, mine.contiguous(), group=group)
    except NotImplementedError:
        dist.all_gather(list(full.chunk(d)), mine.contiguous(), group=group)
    return full


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


class MasterOptimizer:
    """The optimizer over fp32 masters of ``params`` (name → parameter, still fp32 here), sharded over
    ``dp_group`` when ``shard`` (see the module docstring); ``separate_masters``: the model will be cast
    to a low-precision dtype, so keep fp32 copies. ``optimizer`` is the ``torch.optim`` instance (its
    ``param_groups`` take the learning rate)."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        optimizer: str,
        *,
        lr: float,
        weight_decay: float,
        shard: bool = False,
        dp_group=None,
        coords: tuple[int, int, int] = (0, 0, 0),
        dp: int = 1,
        cp: tuple[int, int] = (0, 1),
        separate_masters: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.params = dict(params)
        first = next(iter(self.params.values()), None)
        #: where this rank's collectives' tensors live (its parameters' device; ``device`` without any)
        self.device = first.device if first is not None else torch.device(device or "cpu")
        self.shard = shard and dp > 1
        self.dp_group = dp_group
        self.flats: list[_FlatShard] = []
        self.masters: dict[str, nn.Parameter] = {}
        if self.shard:
            d, p, t = coords
            c, n_cp = cp
            # with cp: one slice per dp × cp rank, r its rank in that group (new_group sorts the ranks)
            r = dist.get_rank(dp_group) if n_cp > 1 else d
            name = f"zero.pp{p}.tp{t}.dp{d}of{dp}" + (f".cp{c}of{n_cp}" if n_cp > 1 else "")
            decay = [q for q in self.params.values() if q.ndim >= 2]
            rest = [q for q in self.params.values() if q.ndim < 2]
            for label, group, two_d in (("decay", decay, True), ("rest", rest, False)):
                flat = _FlatShard(group, dp * n_cp, r, two_d, self.device)
                self.flats.append(flat)
                self.masters[f"{name}.{label}"] = flat.master
        elif not separate_masters:
            self.masters = self.params  # fp32 model: step on the parameters themselves
        else:
            self.masters = {n: nn.Parameter(q.detach().float().clone()) for n, q in self.params.items()}
        self.optimizer = build_optimizer(optimizer, self.masters.items(), lr=lr, weight_decay=weight_decay)

    @property
    def separate_masters(self) -> bool:
        return self.masters is not self.params

    def named_state(self) -> dict[str, nn.Parameter]:
        """What a checkpoint saves and loads (see the module docstring)."""
        if self.shard:
            return {**self.params, **self.masters}
        return dict(self.masters)

    def after_load(self) -> None:
        """After loading a checkpoint into :meth:`named_state`: bring the model parameters in line."""
        if self.separate_masters and not self.shard:
            self._masters_to_params()

    @torch.no_grad()
    def _masters_to_params(self) -> None:
        for n, q in self.params.items():
            q.copy_(self.masters[n])

    @torch.no_grad()
    def reduce_grads(self, dtype: torch.dtype | None = None, timeout_s: float | None = None) -> None:
        """Sharded: the data-parallel reduction of the gradients, one reduce-scatter per flat vector
        (summed in ``dtype``, default the gradients' own; each waited at most ``timeout_s``);
        afterwards the slice-r part of ``.grad`` is the replicas' average (see the module
        docstring). No-op unsharded."""
        for flat in self.flats:
            flat.reduce_grads(self.dp_group, dtype, timeout_s)

    @torch.no_grad()
    def grad_norm(self, norm_params: Sequence[nn.Parameter], groups: Sequence[object]) -> torch.Tensor:
        """Sharded, after :meth:`reduce_grads`: the global gradient norm of ``norm_params`` from the
        slices, Σ‖slice part‖² all-reduced over dp, then over each of ``groups`` (as
        :func:`~pipewright.optim.global_grad_norm` over the full gradients)."""
        counted = {id(p) for p in norm_params}
        parts = [v for flat in self.flats for v in flat.slice_grads(counted)]
        parts = parts or [torch.zeros(0, device=self.device)]  # every rank joins the all-reduces
        grads = [SimpleNamespace(grad=v) for v in parts]
        return global_grad_norm(grads, [self.dp_group, *groups], self.device)

    @torch.no_grad()
    def gather_grads_(self) -> None:
        """Sharded, after :meth:`reduce_grads`: all-gather the averaged slices into every
        parameter's ``.grad``, the full gradients an all-reduce would leave (inspection and tests;
        it sends what the reduce-scatter saved)."""
        for flat in self.flats:
            flat.gather_grads(self.dp_group)

    @torch.no_grad()
    def step(self, grad_factor: float = 1.0) -> None:
        """Masters' gradients ← factor · the parameters' gradients (fp32; sharded: the slice-r part,
        reduced by :meth:`reduce_grads`), optimizer step, parameters ← the updated masters
        (all-gathered over dp when sharded)."""
        if self.shard:
            for flat in self.flats:
                flat.set_grad(grad_factor)
        elif self.separate_masters:
            for n, q in self.params.items():
                self.masters[n].grad = _grad(q).float() * grad_factor
        elif grad_factor != 1.0:
            grads = [q.grad for q in self.params.values() if q.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_factor)
        self.optimizer.step()
        if self.shard:
            for flat in self.flats:
                flat.gather_into_params(self.dp_group)
        elif self.separate_masters:
            self._masters_to_params()

    def state_bytes(self) -> int:
        """Bytes of optimizer state plus separate fp32 masters held by this rank."""
        total = sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.ndim > 0
        )
        if self.separate_masters:
            total += sum(m.numel() * m.element_size() for m in self.masters.values())
        return total
