"""What the planner's estimate reads: the search's caches and device queries (:class:`_Context`), a
candidate's cost pieces (:func:`parts_of`) and its messages (:func:`messages`: the stage-boundary
transfer and the first stage's gradient reduction)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipewright.cost.comm import collective_floor
from pipewright.cost.sharding import like, reduction_time
from pipewright.plan.costs import parts
from pipewright.plan.mapping import DeviceMap
from pipewright.plan.problem import Candidate, Problem


@dataclass
class _Context:
    problem: Problem
    order: tuple[str, ...]
    ar_cache: dict = field(default_factory=dict)
    cost_cache: dict = field(default_factory=dict)
    speeds: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # bytes per device
    sig_cache: dict = field(default_factory=dict)
    bound_cache: dict = field(default_factory=dict)

    def memory_limit(self, devices: Sequence[str]) -> float:
        prob = self.problem
        if prob.memory_limit is not None:
            return prob.memory_limit
        if not self.memory:
            for d in prob.topology.devices:
                self.memory[d] = prob.topology.accelerator(d).memory_bytes
        return min(self.memory[d] for d in devices)

    @property
    def kinds(self) -> frozenset[str]:
        """The accelerator kinds of the topology's devices."""
        return frozenset(self.problem.device_kinds())

    def stage_kinds(self, dmap: DeviceMap, i: int) -> set[str]:
        """The kinds of stage i's devices (without listing them on a one-kind cluster)."""
        if len(self.kinds) == 1:
            return set(self.kinds)
        return {self.problem.topology.nodes[d].accelerator for d in dmap.stage_devices(i)}

    def stage_memory_limit(self, dmap: DeviceMap, i: int) -> float:
        """Bytes each device of stage i may use (the smallest device's, or ``--memory-limit``)."""
        if self.problem.memory_limit is None and len(self.kinds) == 1:
            return self.problem.topology.accelerator(dmap.head(i)).memory_bytes
        return self.memory_limit(dmap.stage_devices(i))

    def signature(self, group: tuple[str, ...]) -> tuple[float, ...]:
        """What a collective's time over ``group`` depends on: its size and its ring's (bus bandwidth,
        per-step latency) (:meth:`~pipewright.topology.Topology.ring_bandwidth`). Groups with one
        signature cost the same, so on a symmetric cluster thousands of groups share a few pricings."""
        if len(group) <= 1:
            return (len(group),)
        hit = self.sig_cache.get(group)
        if hit is None:
            hit = self.sig_cache[group] = (len(group), *self.problem.topology.ring_bandwidth(group))
        return hit

    def all_reduce(self, group: tuple[str, ...], op: str = "all_reduce") -> Callable[[float], float]:
        """Seconds of collective ``op`` of n bytes over ``group``'s devices (the cost model's formula,
        no less than the launched collective's floor, :func:`pipewright.cost.comm.collective_floor`),
        cached per group :meth:`signature`."""
        topo, eff = self.problem.topology, self.problem.efficiency_for().comm
        sig = self.signature(group)
        floor_kind = topo.accelerator(group[0]).name if group else ""

        def f(nbytes: float) -> float:
            if getattr(nbytes, "calls", ()):  # a sharded reduction: its calls, as TopologyComm
                return reduction_time(op, nbytes, lambda k, b: self.all_reduce(group, k)(b))
            key = (op, sig, nbytes, floor_kind)
            hit = self.ar_cache.get(key)
            if hit is None:
                seconds = topo.collective_time(op, group, nbytes / eff)
                hit = self.ar_cache[key] = max(seconds, collective_floor(topo, op, list(group)))
            return hit

        return f

    def p2p(self, a: str, b: str, nbytes: float) -> float:
        key = (a, b, nbytes)
        hit = self.ar_cache.get(key)
        if hit is None:
            eff = self.problem.efficiency_for().comm
            hit = self.ar_cache[key] = self.problem.topology.p2p_time(a, b, nbytes / eff)
        return hit


def parts_of(prob: Problem, c: Candidate):
    """The cost pieces of candidate ``c`` (:func:`pipewright.plan.costs.parts`), its vocabulary padded."""
    spec, opts = prob.spec_for(c.tp), prob.options(c)
    return parts(
        spec, c.microbatch, c.tp, c.recompute, c.sequence_parallel, prob.dtype, prob.efficiency_for(), opts,
        c.ep, next(iter(prob.device_kinds())),
    )  # fmt: skip


def messages(prob: Problem, c: Candidate):
    """(boundary(ctx, a, b): one stage-boundary transfer's seconds from device a to b, grads(layers,
    last): the first stage's gradient reduction bytes as (dense, routed expert) — the dense ones
    reduced over the dp × cp replicas, the experts' over their dp/ep × cp replicas, as
    :class:`~pipewright.cost.moe_cost.MoECost` prices REDUCE_GRAD), from the profile's measurements
    or the analytical pieces. The first stage holds a mixture of experts' first dense layers."""
    b = c.microbatch
    if prob.profile is not None:
        measured = prob.profile.message_seconds(b)  # as the simulation's ProfiledComm prices it
        return (lambda ctx, a, z: measured), lambda n, last: (prob.profile.grad_bytes(b, n, True, last), 0.0)
    pc = parts_of(prob, c)
    first = prob.spec.moe_dense_layers if pc.dense is not None else 0

    def grads(n: int, last: bool) -> tuple[float, float]:
        dense_layers = min(n, first)
        total = (n - dense_layers) * pc.layer.params + pc.embed.params + last * pc.head.params
        total -= pc.shared_params if last and c.pp * c.virtual == 1 else 0.0  # one chunk: a tied table once
        total += dense_layers * pc.dense.params if dense_layers else 0.0
        expert = (n - dense_layers) * pc.expert_params if c.ep > 1 else 0.0
        g = pc.grad_bytes
        return like((total - expert) * g, g), like(expert * g, g)

    return (lambda ctx, a, z: ctx.p2p(a, z, pc.boundary_bytes)), grads
