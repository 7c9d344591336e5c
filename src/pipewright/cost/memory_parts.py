"""Per-rank memory by parts, so a user sees why a stage does not fit.

For pipeline rank r of an analytical cost model (:class:`~pipewright.cost.transformer.TransformerCost`):

- ``weights``, ``gradients``, ``optimizer_state``: the transformer layers' parameters on r × the
  per-parameter bytes of the optimizer sharding (:func:`~pipewright.cost.sharding.state_bytes`);
- ``embedding_output_layer``: the same three for the embedding (chunk 0) and the final norm and output
  layer (last chunk), when r holds them;
- ``activations``: the highest activation memory of r over the simulated iteration — the activations
  of the microbatches in flight (``activation_peak``, from the simulator, less the transient below);
- ``recompute_transient``: what a recomputing backward re-creates on top of the stored activations —
  one layer's, the largest of r's chunks (:func:`~pipewright.cost.chunk_memory.recompute_transient`;
  0 without recomputation). The simulator's peak includes it where it is highest (live bytes before
  a B or I + its transient); the split assumes the peak falls in such a backward, as it does in
  1F1B-style orders where the first backward meets the most microbatches in flight (the sum of the
  two parts is the simulated activation peak either way);
- ``communication_buffers``: the point-to-point send and receive buffers of one boundary activation
  each way, FSDP's gathered weights of two layers and of its root group, and
  ``torch.distributed.pipelining``'s receive buffers for every microbatch
  (:func:`~pipewright.cost.chunk_memory.held_buffer_bytes`);
- ``allocator_reserve``: what PyTorch's caching allocator holds beyond the live tensors —
  fragmentation, estimated at :data:`ALLOCATOR_RESERVE` of the rest. It is reported, not counted by
  the simulator's fit check (``peak_memory_bytes`` = static + activations).

A feature whose own memory the cost model does not hold (K-FAC's factors and kept tensors) adds it as
a part of its own: :func:`register_part` names its column, :func:`with_part` adds it to a rank's parts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipewright.cost.chunk_memory import held_buffer_bytes
from pipewright.cost.layer import edge_parameters
from pipewright.cost.placement import roles
from pipewright.ir import SEND_F, Action, B, I, Schedule

#: the caching allocator's reserve beyond the live tensors, as a fraction of them (an estimate)
ALLOCATOR_RESERVE = 0.05


@dataclass(frozen=True)
class MemoryParts:
    """Bytes per part on one rank (module docstring); ``total`` their sum."""

    weights: float
    gradients: float
    optimizer_state: float
    embedding_output_layer: float
    activations: float
    recompute_transient: float
    communication_buffers: float
    allocator_reserve: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def rank_transient(cost: Any, schedule: Schedule, rank: int) -> float:
    """The largest recomputation transient of ``rank``'s chunks (its B or I), 0 for cost models
    without one."""
    transient = getattr(cost, "transient_bytes", None)
    if transient is None:
        return 0.0
    kinds = {a.kind for a in schedule.actions[rank]} & {B, I}  # the kinds the rank runs
    stages = schedule.stages_of(rank)
    return max((float(transient(Action(s, k, 0), schedule)) for s in stages for k in kinds), default=0.0)


def memory_parts(cost: Any, schedule: Schedule, rank: int, activation_peak: float) -> MemoryParts:
    """:class:`MemoryParts` of pipeline ``rank`` given its simulated ``activation_peak`` (bytes: the
    stored activations and the recomputation transient at the peak)."""
    t = cost.mesh.tp
    state = cost.state()
    layers = edges = 0.0
    for stage in schedule.stages_of(rank):
        chunk = cost._chunk(stage, schedule)
        first, last = roles(cost.layout, stage, schedule.num_stages)
        edge = edge_parameters(cost.spec, t, first, last)
        edges += edge
        layers += chunk.params - edge
    message = cost.message_bytes(Action(0, SEND_F, 0), schedule) if schedule.num_stages > 1 else 0.0
    buffers = 2 * message + held_buffer_bytes(cost.cost_inputs, rank, schedule)
    experts = cost.expert_params(rank, schedule) if hasattr(cost, "expert_params") else 0.0
    ex = cost.expert_state() if experts else state  # routed experts: sharded over dp/ep (MoECost)
    layers -= experts
    static = layers * state.total + experts * ex.total
    activation_peak = max(activation_peak, 0.0)
    transient = min(rank_transient(cost, schedule, rank), activation_peak)
    live = static + edges * state.total + activation_peak + buffers
    return MemoryParts(
        weights=layers * state.weights + experts * ex.weights,
        gradients=layers * state.gradients + experts * ex.gradients,
        optimizer_state=layers * state.optimizer + experts * ex.optimizer,
        embedding_output_layer=edges * state.total,
        activations=activation_peak - transient,
        recompute_transient=transient,
        communication_buffers=buffers,
        allocator_reserve=ALLOCATOR_RESERVE * live,
    )


def rank_memory_parts(cost: Any, schedule: Schedule, peaks: list[float]) -> list[dict[str, float]] | None:
    """Memory parts of every pipeline rank from the simulated peaks (static + activations); None for
    cost models without the analytical parts (unit, profiled)."""
    if not all(hasattr(cost, name) for name in ("state", "gather_buffer_bytes", "_chunk")):
        return None
    out = []
    for rank, peak in enumerate(peaks):
        activation = peak - float(cost.static_bytes(rank, schedule))
        out.append(memory_parts(cost, schedule, rank, activation).as_dict())
    return out


#: parts features add (:func:`register_part`): key → the table's column label
_FEATURE_PARTS: dict[str, str] = {}


def register_part(key: str, label: str) -> None:
    """Name a feature's part ``key`` (its column ``label`` in :func:`memory_table`)."""
    _FEATURE_PARTS[key] = label


def with_part(parts: dict[str, float], key: str, nbytes: float) -> dict[str, float]:
    """A rank's ``parts`` (:meth:`MemoryParts.as_dict`) with a registered feature part ``key`` of
    ``nbytes``: the allocator's reserve grows by :data:`ALLOCATOR_RESERVE` of it, the total by both."""
    if key not in _FEATURE_PARTS:
        raise KeyError(f"memory part {key!r} is not registered (register_part)")
    reserve = ALLOCATOR_RESERVE * nbytes
    return {
        **parts,
        key: nbytes,
        "allocator_reserve": parts["allocator_reserve"] + reserve,
        "total": parts["total"] + nbytes + reserve,
    }


_LABELS = (
    ("weights", "weights"),
    ("gradients", "grads"),
    ("optimizer_state", "optimizer"),
    ("embedding_output_layer", "emb/out"),
    ("activations", "activations"),
    ("recompute_transient", "recompute"),
    ("communication_buffers", "comm bufs"),
    ("allocator_reserve", "reserve"),
    ("total", "total"),
)


def memory_table(parts: list[dict[str, float]]) -> str:
    """The parts of every rank as a text table in GiB (``pipewright simulate``'s output); a feature's
    registered part gets a column before the total where some rank has it."""
    features = tuple((k, label) for k, label in _FEATURE_PARTS.items() if any(k in p for p in parts))
    labels = (*_LABELS[:-1], *features, _LABELS[-1])
    head = "memory (GiB)  " + "".join(f"{label:>12}" for _, label in labels)
    rows = [head]
    for rank, part in enumerate(parts):
        rows.append(f"rank {rank:<8}" + "".join(f"{part.get(key, 0.0) / 2**30:>12.2f}" for key, _ in labels))
    return "\n".join(rows)
