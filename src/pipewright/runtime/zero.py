"""fp32 master weights and optimizer state, optionally sharded over data parallelism (ZeRO-1).

:class:`MasterOptimizer` owns what the optimizer steps on:

- unsharded, fp32 model: the model's parameters themselves (the plain path);
- unsharded, bf16/fp16 model: one fp32 master copy per parameter, same names;
- sharded (ZeRO stage 1, Rajbhandari et al., SC20): this rank's parameters are laid end to end in two
  flat fp32 vectors (matrices, which get weight decay, and the rest), each padded to a multiple of d
  (the data-parallel size) and cut into d equal slices; dp rank r keeps only slice r as its master
  and keeps the optimizer state for that slice only — 1/d of the fp32 masters and of Adam's moments
  per rank. A step copies slice r of the (already dp-averaged) gradients into the master's gradient,
  steps, and all-gathers the d updated slices over the dp group into every replica's parameters.

Element-wise optimizers (SGD with momentum, AdamW) give the same update on a slice as on the whole
tensor, so sharded and unsharded training agree to rounding. Gradient clipping uses the global norm
of the full gradients (every replica holds them after the all-reduce), computed before the step;
the clipping factor, and under fp16 the 1/S loss-scale factor, are applied while the gradients are
copied into the fp32 master gradients.

Checkpoints: :meth:`MasterOptimizer.named_state` names what to save — the masters under the
parameters' names when they are full copies; with sharding the model parameters plus each rank's
slices under ``zero.pp{p}.tp{t}.dp{r}of{d}.{decay|rest}`` (with their optimizer state), so a sharded
checkpoint resumes with the same dp, pp and tp.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipewright.optim import build_optimizer


class _FlatShard:
    """One flat group of parameters and this rank's slice [lo, hi) of it."""

    def __init__(self, params: list[nn.Parameter], d: int, r: int, two_d: bool) -> None:
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.size = -(-max(total, 1) // d)  # slice length (padded)
        self.lo, self.hi = r * self.size, (r + 1) * self.size
        flat = torch.zeros(self.size, dtype=torch.float32, device=params[0].device if params else "cpu")
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

    def gather_into_params(self, group) -> None:
        """All-gather the d slices and write them into the parameters (cast to their dtype)."""
        d = dist.get_world_size(group)
        parts = [torch.empty_like(self.master.data.view(-1)) for _ in range(d)]
        dist.all_gather(parts, self.master.data.view(-1).contiguous(), group=group)
        full = torch.cat(parts)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets, strict=True):
                p.copy_(full[off : off + p.numel()].view_as(p))


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
        separate_masters: bool = False,
    ) -> None:
        self.params = dict(params)
        self.shard = shard and dp > 1
        self.dp_group = dp_group
        self.flats: list[_FlatShard] = []
        self.masters: dict[str, nn.Parameter] = {}
        if self.shard:
            d, p, t = coords
            decay = [q for q in self.params.values() if q.ndim >= 2]
            rest = [q for q in self.params.values() if q.ndim < 2]
            for label, group, two_d in (("decay", decay, True), ("rest", rest, False)):
                flat = _FlatShard(group, dp, d, two_d)
                self.flats.append(flat)
                self.masters[f"zero.pp{p}.tp{t}.dp{d}of{dp}.{label}"] = flat.master
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
    def step(self, grad_factor: float = 1.0) -> None:
        """Masters' gradients ← factor · the parameters' gradients (fp32), optimizer step, parameters ←
        the updated masters (all-gathered over dp when sharded)."""
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
