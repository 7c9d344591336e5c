"""The analytical cost of mixture-of-experts decoders: :class:`MoECost`, a TransformerCost whose MoE
layers (``spec.is_moe_layer``) price their router, experts and all-to-all (:mod:`pipewright.cost.moe`).

Per MoE layer of a chunk and microbatch, per device (tensor-parallel size t, context-parallel size c,
expert-parallel size e carved from dp, expert load imbalance φ ≥ 1: the busiest device's expert tokens
over the even split, Megatron-LM's and DeepSeek's reported max/mean load):

- The dense MLP's FLOPs and GEMMs are replaced by the router's (T × E × h) and the experts' on the
  busiest device of the ep group (:func:`~pipewright.cost.moe.expert_gemms` with capacity φ, T = b·s/c
  tokens, experts split over t as Megatron-LM's default expert tensor parallelism); model FLOPs count
  the activated experts at φ = 1 (k + shared experts per token).
- All-to-all: dispatch and combine in the forward, their gradients in the backward (I; twice more in
  I under full recomputation), each moving T·k·φ·h/t 16-bit elements per device (sequence-parallel
  tokens) over the ep group; priced as an all-gather of that size over the topology (the same (e − 1)/e
  of the bytes leave each device) and added to the action's time; :meth:`MoECost.exposed_comm` gives
  it apart, so that F&B pairs overlap it (``pipewright simulate`` with a schedule that marks them:
  ``dualpipev``, ``1f1b-overlap``).
- Stored activations: :func:`~pipewright.cost.moe.moe_stored_units` (flash attention, no scores; with
  ``dtype="fp8"`` the expert GEMMs' inputs as FP8 copies).
- Recomputation transient (a recomputing backward's re-created activations on top of the stored
  ones, :func:`~pipewright.cost.chunk_memory.transient_bytes`): a MoE layer re-creates what it
  stores without recomputation less what it kept (:meth:`MoECost.moe_layer_transient`) — with full
  recomputation the expert FFN activations of the tokens routed to the rank included; a chunk's is
  the largest of its layer kinds'. The backward's own gradient buffers are not priced.
- Parameters: attention, router and shared experts as the dense layer's (/t); the routed experts E/e
  per device (/t). Static memory prices the expert parameters' optimizer-state sharding over their
  own replicas (dp/e × c), the rest over dp × c.

The attention block is the spec's kind (DeepSeek-V3: multi-head latent attention,
:mod:`pipewright.cost.mla`); a multi-token-prediction block past the model's layers is a MoE layer when
the model's last layer is (:meth:`MoECost._moe_layers`, :mod:`pipewright.cost.mtp`).

- Gradient reduction (REDUCE_GRAD): the routed experts' gradients over their dp·cp/e replicas
  (Megatron-Core's expert-data-parallel group), the rest over dp × cp, one after the other
  (:class:`ExpertComm`, :meth:`MoECost.grad_reductions`).

- FSDP without pipelining (pp = 1: weights gathered and gradients reduce-scattered per layer and
  microbatch): the routed experts' over the expert-data-parallel group, the rest over dp × cp
  (:meth:`MoECost._fsdp_comm`).

Not priced (stated in docs/moe.md): the memory-bound traffic of the expert MLPs beyond the dense
MLP's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.chunk_memory import (
    layer_stored_bytes,
    stored_memory_bytes,
    weight_element_bytes,
)
from pipewright.cost.comm import TopologyComm
from pipewright.cost.layer import mlp_gemms, mlp_matrices
from pipewright.cost.moe import MoE, _expert_parameters, expert_gemms, moe_stored_units
from pipewright.cost.sharding import (
    Reduction,
    StateBytes,
    pipelined_fsdp_state,
    reduce_dtype_bytes,
    state_bytes,
)
from pipewright.cost.transformer import DTYPE_BYTES, TransformerCost, _Chunk
from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD, Action, B, F, I, Schedule, W
from pipewright.models.spec import ModelSpec


def moe_of(spec: ModelSpec, imbalance: float = 1.0) -> MoE:
    """The :class:`~pipewright.cost.moe.MoE` of ``spec``'s MoE fields, capacity φ = ``imbalance``."""
    return MoE(
        spec.moe_experts,
        spec.moe_top_k,
        spec.moe_ffn_hidden,
        spec.moe_shared_experts,
        capacity=imbalance,
    )


def check_expert_parallel(spec: ModelSpec, ep: int, dp: int) -> None:
    """One-line errors: ep must divide the experts and dp; top-k at most the experts."""
    if spec.moe_top_k > spec.moe_experts:
        raise ConfigError(f"--moe-top-k {spec.moe_top_k} exceeds --moe-experts {spec.moe_experts}")
    if ep > 1 and spec.moe_experts % ep:
        raise ConfigError(f"--ep {ep} must divide the {spec.moe_experts} experts")
    if dp % ep:
        raise ConfigError(f"--ep {ep} must divide --dp {dp} (expert parallelism is carved from dp)")


class GradBytes(Reduction):
    """The bytes one REDUCE_GRAD reduces per device: a float (their total, what any reader of
    ``message_bytes`` sees) of which ``expert`` are routed-expert gradients, which
    :class:`ExpertComm` reduces over the expert-data-parallel group instead of dp × cp; ``calls`` the
    collectives of a sharded optimizer's reduction (:class:`~pipewright.cost.sharding.Reduction`)."""

    expert: float

    def __new__(cls, total: float, expert: float, calls: tuple = ()) -> GradBytes:
        out = super().__new__(cls, total, calls)
        out.expert = expert
        return out

    def __reduce__(self):
        return (GradBytes, (float(self), self.expert, self.calls))

    def part(self, factor: float) -> GradBytes:
        """One call's bytes, its expert share kept apart."""
        return GradBytes(float(self) * factor, self.expert * factor)


@dataclass(frozen=True, eq=False)
class ExpertComm(TopologyComm):
    """:class:`~pipewright.cost.comm.TopologyComm` that reduces a :class:`GradBytes`' expert share over
    the expert-data-parallel group (Megatron-Core's ``expert_data_parallel_group``: the dp·cp/ep ranks
    of the stage holding the same experts) and the rest over dp × cp: the two reductions one after
    the other."""

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        expert = getattr(nbytes, "expert", 0.0)
        if group != "dp" or not expert or nbytes.calls:  # a sharded reduction: call by call
            return super().collective_time(kind, rank, nbytes, group, members)
        dense = super().collective_time(kind, rank, float(nbytes) - expert, "dp")
        return dense + self.expert_time(kind, rank, expert)

    def expert_group(self, rank: int) -> tuple[int, ...]:
        """The global ranks of pipeline rank ``rank``'s expert-data-parallel group (its dp × cp
        replicas with the same ep rank)."""
        mesh = self.mesh
        own = mesh.ep_rank(mesh.global_rank(rank))
        return tuple(g for g in mesh.grad_group(rank) if mesh.ep_rank(g) == own)

    def expert_time(self, kind: str, rank: int, nbytes: float) -> float:
        """Collective ``kind`` of ``nbytes`` over :meth:`expert_group`."""
        key = ("expert_dp", kind, rank, nbytes)
        hit = self._memo.get(key)
        if hit is None:
            devices = [self._device(g) for g in self.expert_group(rank)]
            hit = self._memo[key] = self.topology.collective_time(
                kind, devices, nbytes / self.bandwidth_efficiency
            )
        return hit


@dataclass(frozen=True, eq=False)
class MoECost(TransformerCost):
    """:class:`~pipewright.cost.transformer.TransformerCost` of a mixture-of-experts spec (module
    docstring); ``moe_imbalance`` φ ≥ 1: the busiest device's expert tokens over the even split."""

    moe_imbalance: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_imbalance < 1:
            raise ConfigError(f"--moe-imbalance must be at least 1 (got {self.moe_imbalance})")
        check_expert_parallel(self.spec, self.mesh.ep, self.mesh.dp)
        if self.mesh.ep > 1:  # expert gradients reduced over their own replicas
            comm = self.comm
            object.__setattr__(self, "comm", ExpertComm(comm.topology, comm.mesh, comm.bandwidth_efficiency))

    def _moe_layers(self, stage: int, layers: tuple[int, ...]) -> int:
        """MoE layers of chunk ``stage``: by index; an index past the model's layers is a
        multi-token-prediction block (:mod:`pipewright.cost.mtp`), of the kind of the last layer."""
        spec, start = self.spec, sum(layers[:stage])
        last = spec.is_moe_layer(spec.layers - 1)
        indices = range(start, start + layers[stage])
        return sum(spec.is_moe_layer(i) if i < spec.layers else last for i in indices)

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        dense = super()._build_chunk(stage, num_stages, layers)
        k = self._moe_layers(stage, layers)
        if not k:
            return dense
        spec, b, t, c, ep = self.spec, self.microbatch, self.mesh.tp, self.cp, self.mesh.ep
        s, h = spec.seq_len, spec.hidden
        moe, even = moe_of(spec, self.moe_imbalance), moe_of(spec)
        f, mu, tokens = spec.ffn_hidden, mlp_matrices(spec), b * s / c
        full = self.recompute == "full"
        # FLOPs (whole layer, before the /t/c split the dense chunk applied)
        dense_mlp = 2 * b * s * mu * h * f
        router = 2 * b * s * h * spec.moe_experts
        experts = 2 * b * s * (even.top_k + even.shared) * mu * h * even.ffn(spec)
        busiest = 2 * b * s * (moe.top_k * moe.capacity + moe.shared) * mu * h * moe.ffn(spec)
        tc = t * c
        d_model = k * (router + experts - dense_mlp) / tc
        d_exec = k * (router + busiest - dense_mlp) / tc
        model = {F: d_model, I: d_model, W: d_model}
        executed = {F: d_exec, I: d_exec * (2 if full else 1), W: d_exec}
        # GEMMs: the dense MLP's two GEMM kinds out, router and experts in
        mlp = mlp_gemms(spec, tokens, t)
        moe_fwd = [((tokens, spec.moe_experts, h), 1), *expert_gemms(spec, moe, tokens, ep, t)]

        def swap(kind_gemms, transform):
            out = list(kind_gemms)
            for m, nn, kk in mlp:  # the k MoE layers leave the dense MLP's entry (count = layers)
                shape = transform(m, nn, kk, 0)[:3]
                i = next(j for j, g in enumerate(out) if g[:3] == shape and g[3] >= k)
                out[i] = (*shape, out[i][3] - k)
            for (m, nn, kk), cnt in moe_fwd:
                out.append(transform(m, nn, kk, cnt * k))
            return [g for g in out if g[3]]

        fwd = swap(dense.gemms[F], lambda m, nn, kk, n: (m, nn, kk, n))
        dgrad = swap(dense.gemms[I], lambda m, nn, kk, n: (m, kk, nn, n))
        if full:
            dgrad = swap(dgrad, lambda m, nn, kk, n: (m, nn, kk, n))
        wgrad = swap(dense.gemms[W], lambda m, nn, kk, n: (nn, kk, m, n))
        gemms = {F: tuple(fwd), I: tuple(dgrad), W: tuple(wgrad)}
        gemms[B] = gemms[I] + gemms[W]
        # stored activations
        memory = dict(dense.memory)
        if not full:
            scale = DTYPE_BYTES[self.act_dtype] / 2
            dense_layer = self.layer_stored_bytes() / c
            fp8 = self.dtype == "fp8"
            units = moe_stored_units(spec, moe, t, self.sequence_parallel, fp8)
            moe_layer = s * b * h * scale * units / c
            delta = k * (moe_layer - dense_layer)
            memory[F] += delta
            memory[B] -= delta
            memory[I] -= delta
        # parameters per device
        dense_mlp_params = _expert_parameters(spec, MoE(1, 1, f)) / t
        router_params = h * spec.moe_experts
        routed = self.routed_params()
        shared = spec.moe_shared_experts * _expert_parameters(spec, even) / t
        params = dense.params + k * (router_params + shared - dense_mlp_params + routed)

        def plus(table, delta):
            out = {kind: table[kind] + delta.get(kind, 0.0) for kind in (F, I, W)}
            out[B] = out[I] + out[W]
            return out

        return _Chunk(
            plus(dense.flops, executed),
            plus(dense.model_flops, model),
            dense.tp_bytes,
            dense.traffic,
            memory,
            params,
            gemms,
            dense.attention,
            dense.ring_bytes,
            dense.layers,
            k,
            first=dense.first,
            last=dense.last,
        )

    def moe_layer_stored(self, mode: str | None = None) -> float:
        """Bytes one MoE layer keeps per microbatch and device under ``mode`` (default: the model's),
        before the context-parallel split, as :meth:`_build_chunk` stores them: the dense layer's
        (:func:`~pipewright.cost.chunk_memory.stored_memory_bytes`) with its own count
        (:func:`~pipewright.cost.chunk_memory.layer_stored_bytes`) replaced by
        :func:`~pipewright.cost.moe.moe_stored_units` — the expert FFN activations of the k·φ token
        slots routed to the rank and of the shared experts —; the layer input alone under full."""
        mode = mode or self.recompute
        dense = stored_memory_bytes(self.cost_inputs, mode)
        if mode == "full":
            return dense
        spec, t = self.spec, self.mesh.tp
        moe = moe_of(spec, self.moe_imbalance)
        units = moe_stored_units(spec, moe, t, self.sequence_parallel, self.dtype == "fp8")
        scale = DTYPE_BYTES[self.act_dtype] / 2
        moe_bytes = spec.seq_len * self.microbatch * spec.hidden * scale * units
        return dense + moe_bytes - layer_stored_bytes(self.cost_inputs, mode)

    def moe_layer_transient(self) -> float:
        """One MoE layer's recomputation transient per microbatch and device: what its recomputed
        forward re-creates, (:meth:`moe_layer_stored` none − under the model's mode)/c
        (:func:`~pipewright.cost.chunk_memory.recompute_transient` for a dense layer)."""
        return max(self.moe_layer_stored("none") - self.moe_layer_stored(), 0.0) / self.cp

    def layer_transient(self) -> float:
        """The largest one-layer recomputation transient of the model's layer kinds (dense and MoE)."""
        dense = super().layer_transient()
        if not any(self.spec.is_moe_layer(i) for i in range(self.spec.layers)):
            return dense
        moe = self.moe_layer_transient()
        return moe if all(self.spec.is_moe_layer(i) for i in range(self.spec.layers)) else max(dense, moe)

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """The recomputation transient of the action's chunk (:func:`chunk_memory.transient_bytes`)
        with the largest of its layers' kinds: a MoE layer's (:meth:`moe_layer_transient`), a dense
        layer's."""
        chunk = self._chunk(action.stage, schedule)
        if not chunk.moe_layers:
            layer = self.layer_transient() if chunk.layers and action.kind in (B, I) else 0.0
            return self.recompute_transient_bytes(action, schedule, layer)
        layer = self.moe_layer_transient()
        if chunk.moe_layers < chunk.layers:
            layer = max(layer, super().layer_transient())
        return self.recompute_transient_bytes(action, schedule, layer)

    def _fsdp_comm(self, chunk: _Chunk, kind: str, rank: int) -> float:
        """FSDP per microbatch (pp = 1, :meth:`~pipewright.cost.transformer.TransformerCost._fsdp_comm`)
        with ep > 1: the routed experts' 16-bit weights all-gathered and their gradients
        reduce-scattered over the expert-data-parallel group (:meth:`ExpertComm.expert_group`, where
        their state is sharded), the rest over dp × cp; each pair one after the other."""
        expert = chunk.moe_layers * self.routed_params() if self.mesh.ep > 1 else 0.0
        if not expert:
            return super()._fsdp_comm(chunk, kind, rank)
        comm, dense = self.comm, chunk.params - expert
        time = comm.collective_time("all_gather", rank, dense * 2.0, group="dp")
        time += comm.expert_time("all_gather", rank, expert * 2.0)
        if kind == F:
            return time
        reduced = reduce_dtype_bytes(self.grad_dtype, self.dtype)
        time += comm.collective_time("reduce_scatter", rank, dense * reduced, group="dp")
        return time + comm.expert_time("reduce_scatter", rank, expert * reduced)

    def routed_params(self) -> float:
        """Routed-expert parameters per device in one MoE layer: E/e experts, each split over t."""
        spec = self.spec
        return spec.moe_experts // self.mesh.ep * _expert_parameters(spec, moe_of(spec)) / self.mesh.tp

    def a2a_bytes(self) -> float:
        """Bytes one device sends in one all-to-all (dispatch or combine) of one MoE layer."""
        spec, t = self.spec, self.mesh.tp
        tokens = self.microbatch * spec.seq_len / self.cp / t
        return tokens * spec.moe_top_k * self.moe_imbalance * spec.hidden * DTYPE_BYTES[self.act_dtype]

    def a2a_time(self, chunk: _Chunk, kind: str, rank: int) -> float:
        """Seconds of the all-to-alls of one ``kind`` action of ``chunk`` on pipeline rank ``rank``."""
        calls = self.a2a_calls(chunk, kind)
        if not calls:
            return 0.0
        return calls * self.comm.collective_time("all_gather", rank, self.a2a_bytes(), group="ep")

    def a2a_calls(self, chunk: _Chunk, kind: str) -> int:
        """The all-to-alls of :meth:`a2a_bytes` one ``kind`` action of ``chunk`` runs: per MoE layer
        dispatch and combine in F and in I/B (twice more there under full recomputation); none in W
        or with ep = 1."""
        if self.mesh.ep == 1 or kind == W or not chunk.moe_layers:
            return 0
        return chunk.moe_layers * (2 + (2 if kind in (I, B) and self.recompute == "full" else 0))

    def kind_time(self, chunk: _Chunk, kind: str, rank: int) -> float:
        """The dense terms plus the all-to-alls (module docstring)."""
        return super().kind_time(chunk, kind, rank) + self.a2a_time(chunk, kind, rank)

    def exposed_comm(self, action: Action, schedule: Schedule) -> float:
        """The all-to-all seconds inside ``compute_time(action)``: what DualPipe's F&B pairs overlap
        (:class:`pipewright.sim.pair_overlap.PairOverlapCost`)."""
        if action.kind not in (F, B, I, W):
            return 0.0
        rank = schedule.rank_of(action.stage)
        return self.a2a_time(self._chunk(action.stage, schedule), action.kind, rank)

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        """The dense model's; a REDUCE_GRAD's as :class:`GradBytes`, its routed-expert gradients
        apart (with ep > 1, reduced over the expert-data-parallel group by :class:`ExpertComm`)."""
        nbytes = super().message_bytes(action, schedule)
        if action.kind != REDUCE_GRAD or self.mesh.ep == 1 or not nbytes:
            return nbytes
        calls = getattr(nbytes, "calls", ())
        return GradBytes(nbytes, self.grad_reductions(action.stage, schedule)["expert_dp"], calls)

    def grad_reductions(self, stage: int, schedule: Schedule) -> dict[str, float]:
        """Bytes per device stage ``stage``'s gradient reduction sends, by group: ``dp`` (the dp × cp
        replicas: attention, router, shared experts, norms, embedding, output layer) and ``expert_dp``
        (the dp·cp/ep replicas of its routed experts; with ep = 1 the same group, so counted in dp)."""
        chunk = self._chunk(stage, schedule)
        total = chunk.params * self.grad_bytes
        expert = chunk.moe_layers * self.routed_params() * self.grad_bytes if self.mesh.ep > 1 else 0.0
        return {"dp": total - expert, "expert_dp": expert}

    def expert_params(self, rank: int, schedule: Schedule) -> float:
        """Routed-expert parameters per device on pipeline ``rank``."""
        routed = self.routed_params()
        return sum(self._chunk(c, schedule).moe_layers * routed for c in schedule.stages_of(rank))

    def expert_state(self) -> StateBytes:
        """Bytes per routed-expert parameter: the dense parameters' (:meth:`state`: the gradient
        buffer's dtype, pipelined FSDP's gathered weights) with the sharding over the expert replicas
        (dp/ep × cp) instead of dp × cp."""
        group = self.mesh.dp // self.mesh.ep * self.cp
        weight = weight_element_bytes(self.cost_inputs)
        state = state_bytes(self.optimizer_sharding, group, self.bytes_per_param, self.grad_dtype, weight)
        if self.optimizer_sharding == "fsdp" and not self.regathers:
            state = pipelined_fsdp_state(state, self.fsdp_grad_sync, self.grad_dtype)
        return state

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        """Weights, gradients and optimizer state: the routed experts' state sharded over their own
        replicas (dp/ep × cp), the rest as the dense model's."""
        base = super().static_bytes(rank, schedule)
        if self.optimizer_sharding == "none" or self.mesh.ep == 1:
            return base
        extra = self.expert_state().total - self.state().total
        return base + self.expert_params(rank, schedule) * extra
