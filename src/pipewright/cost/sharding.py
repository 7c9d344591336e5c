"""Optimizer-state sharding over the data-parallel replicas: none, ZeRO-1 and FSDP (ZeRO-3).

Mixed-precision Adam keeps, per parameter (Megatron-LM's accounting): the 16-bit weight (2 bytes), the
fp32 gradient accumulator (4) and the optimizer state — an fp32 master weight and Adam's two fp32
moments (12) — 18 bytes in all (``bytes_per_param``; the optimizer state is what is left after the
weight and the gradient). With 16-bit gradient buffers (``grad_bytes`` 2: Megatron-Core's
``grad_reduce_in_fp32=False``, the default of ``DistributedDataParallelConfig`` and of NVIDIA's NeMo and
Megatron-Bridge performance recipes; Apex's ``DistributedFusedAdam`` with ``grad_sync_dtype: bf16``)
the gradient takes 2 bytes and the optimizer state keeps its 12: 16 in all. Over d = dp × cp replicas
of a stage (Rajbhandari et al. 2020):

- ``none``: every replica holds all 18 bytes; the gradients are all-reduced (REDUCE_GRAD).
- ``zero1`` (Megatron's distributed optimizer, ZeRO-1/2): the optimizer state is sharded, 2 + 4 + 12/d
  bytes; the gradients are reduce-scattered and the updated weights all-gathered: REDUCE_GRAD is those
  two collectives, priced one after the other (:func:`reduction_calls`).
- ``fsdp`` (ZeRO-3): weights, gradients and optimizer state sharded, 18/d bytes, plus the gathered
  16-bit weights of the layers in flight (two layers: the one computing and the one prefetched). Each
  layer's weights are all-gathered before its forward and again before its backward, and its gradients
  reduce-scattered after the backward; the transfers overlap the neighbouring layers' compute
  (prefetch), so only what exceeds it is exposed (:func:`exposed`). No REDUCE_GRAD at the end. With
  pipeline parallelism the gathered weights stay for the whole step (they would otherwise be gathered
  for every microbatch; Llama 3 and torchtitan run it so): the weights are held unsharded (2 bytes), one
  all-gather and one reduce-scatter per iteration — priced as REDUCE_GRAD. Where the gradients wait
  for the step (``grad_sync="step"``: torch.distributed.pipelining turns FSDP2's gradient sync off for
  every backward but the last, and FSDP2 accumulates the unsharded gradients in its reduce dtype, fp32
  in torchtitan) they are held unsharded too, in the gradient buffer's dtype; with
  ``grad_sync="microbatch"`` (Llama 3 §3.3.2: gradients sharded) they stay /d.

The data-parallel reduction moves the gradient buffer's dtype (:func:`reduction_bytes`): Megatron-LM
sets ``accumulate_allreduce_grads_in_fp32`` for ``--bf16`` (megatron/training/arguments.py), so a bf16
run all-reduces 4 bytes per parameter; Megatron-Core's DDP reduces in fp32 with ``grad_reduce_in_fp32``
and in the parameter dtype without; fp16 runs keep Megatron's default (False: the fp16 gradients are
reduced). The distributed optimizer reduce-scatters the buffer in its dtype and all-gathers the
parameters in theirs (2 bytes); FSDP2 reduce-scatters in its ``reduce_dtype`` (fp32 in torchtitan's
``mixed_precision_reduce``) and all-gathers the 16-bit weights.

A REDUCE_GRAD's bytes are a :class:`Reduction`: a float, the bytes of the one ring all-reduce that
takes as long at full bandwidth (what :func:`reduction_bytes` returned before the calls were priced
apart, and what readers of ``message_bytes`` still see), which carries the collectives it is made of.
The communication model prices each call as its own collective (:func:`reduction_time`): under NCCL's
model a reduce-scatter and an all-gather each pay a call's base latency and n − 1 ring steps (N − 1 of
them across hosts, no tree algorithm, no multi-host plateau factor), where one all-reduce of the same
volume would pay 2(n − 1) steps (2N across hosts), the plateau and the choice of a tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipewright.errors import ConfigError

SHARDING = ("none", "zero1", "fsdp")
WEIGHT_BYTES = 2.0
GRAD_BYTES = 4.0
#: gradient buffer dtypes and their bytes: fp32 (Megatron-LM forces it for bf16) or bf16
GRAD_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0}


def check_sharding(mode: str, grad_dtype: str = "fp32") -> None:
    """One-line errors for an unknown optimizer sharding or gradient dtype."""
    if mode not in SHARDING:
        raise ConfigError(f"optimizer sharding must be one of {', '.join(SHARDING)} (got {mode!r})")
    if grad_dtype not in GRAD_DTYPE_BYTES:
        raise ConfigError(f"--grad-dtype must be one of {', '.join(GRAD_DTYPE_BYTES)} (got {grad_dtype!r})")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter a rank holds for weights, gradients and optimizer state."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def state_bytes(
    mode: str,
    replicas: int,
    bytes_per_param: float = 18.0,
    grad_dtype: str = "fp32",
    weight_bytes: float = WEIGHT_BYTES,
) -> StateBytes:
    """Per-parameter bytes on one rank under ``mode`` with ``replicas`` = dp × cp (module docstring);
    ``bytes_per_param`` counts an fp32 gradient, ``grad_dtype`` is the gradient buffer's. With fp32
    weights (``weight_bytes`` 4: training in fp32) the weights are the masters: 4 + 4 + Adam's 8, 16
    bytes, where mixed precision keeps 18."""
    check_sharding(mode, grad_dtype)
    weights = min(WEIGHT_BYTES, bytes_per_param)
    fp32_grads = min(GRAD_BYTES, bytes_per_param - weights)
    optimizer = bytes_per_param - weights - fp32_grads
    if weight_bytes > weights:
        optimizer, weights = max(0.0, optimizer - weight_bytes), weight_bytes
    grads = min(GRAD_DTYPE_BYTES[grad_dtype], fp32_grads)
    if mode == "zero1":
        return StateBytes(weights, grads, optimizer / replicas)
    if mode == "fsdp":
        return StateBytes(weights / replicas, grads / replicas, optimizer / replicas)
    return StateBytes(weights, grads, optimizer)


#: when pipelined FSDP reduce-scatters the gradients: after every microbatch or once per step
GRAD_SYNC = ("microbatch", "step")


def pipelined_fsdp_state(state: StateBytes, grad_sync: str, grad_dtype: str = "fp32") -> StateBytes:
    """Pipelined FSDP: the 16-bit weights stay gathered for the step, and with ``grad_sync="step"`` the
    gradients accumulate unsharded (module docstring)."""
    if grad_sync not in GRAD_SYNC:
        raise ConfigError(f"--fsdp-grad-sync must be one of {', '.join(GRAD_SYNC)} (got {grad_sync!r})")
    grads = GRAD_DTYPE_BYTES[grad_dtype] if grad_sync == "step" else state.gradients
    return StateBytes(WEIGHT_BYTES, grads, state.optimizer)


def reduce_dtype_bytes(grad_dtype: str, dtype: str = "bf16") -> float:
    """Bytes per gradient element of the data-parallel reduction: the gradient buffer's dtype, except
    under fp16 training, whose Megatron default reduces the fp16 gradients (module docstring)."""
    check_sharding("none", grad_dtype)
    return WEIGHT_BYTES if dtype == "fp16" else GRAD_DTYPE_BYTES[grad_dtype]


#: a call of the data-parallel reduction: (collective kind, bytes per parameter or per byte)
Call = tuple[str, float]
#: bytes a call moves per rank, in units of a ring all-reduce's 2(d − 1)/d: reduce-scatter and
#: all-gather each move (d − 1)/d of their bytes
_RING_SHARE = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5}


def reduction_calls(
    mode: str, grad_dtype: str, dtype: str = "bf16", gather_overlapped: bool = False
) -> tuple[Call, ...]:
    """The collectives of the step's data-parallel gradient traffic, each with its bytes per parameter:
    an all-reduce of R = :func:`reduce_dtype_bytes` (``none``); a reduce-scatter of R then an all-gather
    of the 2-byte parameters (``zero1``, ``fsdp``). With ``gather_overlapped`` (Megatron-Core's
    ``overlap_param_gather``, which goes with ``--overlap-grad-reduce``: the distributed optimizer's
    parameter all-gather runs bucket by bucket under the next iteration's forward,
    distributed_data_parallel.py's forward pre-hooks) ``zero1`` keeps the reduce-scatter alone."""
    check_sharding(mode, grad_dtype)
    r = reduce_dtype_bytes(grad_dtype, dtype)
    if mode == "none":
        return (("all_reduce", r),)
    if mode == "zero1" and gather_overlapped:
        return (("reduce_scatter", r),)
    return (("reduce_scatter", r), ("all_gather", WEIGHT_BYTES))


class Reduction(float):
    """Bytes of a data-parallel reduction (module docstring): the float is the ring all-reduce that
    takes as long at full bandwidth; ``calls`` the collectives it is made of, each as (kind, its bytes
    per byte of the float)."""

    calls: tuple[Call, ...]

    def __new__(cls, value: float, calls: tuple[Call, ...] = ()) -> Reduction:
        out = super().__new__(cls, value)
        out.calls = tuple(calls)
        return out

    def __reduce__(self):
        return (Reduction, (float(self), self.calls))

    @classmethod
    def of(cls, calls: tuple[Call, ...]) -> Reduction:
        """Bytes per parameter of ``calls`` (kind, bytes per parameter): Σ bytes × the kind's ring share."""
        value = sum(b * _RING_SHARE[k] for k, b in calls)
        return cls(value, tuple((k, b / value) for k, b in calls))

    def part(self, factor: float) -> float:
        """The bytes of a call that moves ``factor`` bytes per byte of this reduction."""
        return float(self) * factor


def like(nbytes: float, reduction: float) -> float:
    """``nbytes`` made of the calls of ``reduction`` (a plain float where it has none)."""
    calls = getattr(reduction, "calls", ())
    return Reduction(float(nbytes), calls) if calls else float(nbytes)


def reduction_parts(kind: str, nbytes: float) -> tuple[tuple[str, float], ...]:
    """The (kind, bytes) collectives a ``kind`` of ``nbytes`` runs: a :class:`Reduction`'s calls for an
    all-reduce that carries them, else the one collective."""
    calls = getattr(nbytes, "calls", ())
    if kind != "all_reduce" or not calls:
        return ((kind, nbytes),)
    return tuple((k, nbytes.part(f)) for k, f in calls)


#: float64 scalars the training step all-reduces over the data-parallel group besides the gradients:
#: the loss and its microbatch count, and the gradient norm's sum of squares
LOSS_SCALARS, NORM_SCALARS = 2, 1


def step_scalar_bytes(dp: int, norm_over_dp: bool, cp: int = 1) -> float:
    """Bytes the training step all-reduces over the data-parallel group besides the gradients: the
    loss and its count (2 × 8 bytes) when dp > 1, and the gradient norm's Σ g² (8 bytes) where its
    terms are split over the replicas (``norm_over_dp``: ZeRO-1's gradient slices, or experts that
    differ between replicas) — 16 or 24 bytes, 0 with dp = 1; with cp > 1 also the loss's mean over
    the cp ranks (8 bytes)."""
    over_cp = 8.0 if cp > 1 else 0.0
    if dp <= 1:
        return over_cp
    return 8.0 * (LOSS_SCALARS + (NORM_SCALARS if norm_over_dp else 0)) + over_cp


def tp_step_bytes(cost, stage: int, schedule) -> tuple[float, ...]:
    """All-reduce bytes the training step sends over ``stage``'s tensor-parallel group at tp > 1: with
    sequence parallelism the chunk's :func:`~pipewright.cost.layer.replicated_parameters` gradients in
    the gradient dtype (one call a chunk that holds any: not an embedding-only one, whose position table
    needs none); on the rank's first stage the gradient norm's Σ g² (8 bytes, each tp rank's sum over
    its shards)."""
    from pipewright.cost.layer import replicated_parameters

    if cost.mesh.tp == 1:
        return ()
    chunk = cost._chunk(stage, schedule)
    mtp = cost.spec.mtp_depth if chunk.last else 0
    count = replicated_parameters(cost.spec, chunk.layers, chunk.last, mtp) if cost.sequence_parallel else 0
    out = (count * GRAD_DTYPE_BYTES[cost.grad_dtype],) if count else ()
    if stage == min(schedule.stages_of(schedule.rank_of(stage))):
        out += (8.0 * NORM_SCALARS,)
    return out


def tied_step_bytes(cost, stage: int, schedule) -> float:
    """All-reduce bytes the training step sends for a tied model's embedding table on ``stage``: where
    the first and the last stage run on different pipeline ranks, each of the two all-reduces the
    table's gradient over the pair of them (V·h/t elements in the gradient dtype; the runtime's
    ``TiedEmbeddings.sync_grads``, Megatron-LM's ``_allreduce_embedding_grads``); 0 on any other stage,
    untied, or when one rank holds both ends (a local add, or one Parameter at one stage)."""
    from pipewright.cost.layer import shared_table_parameters

    last = schedule.num_stages - 1
    if stage not in (0, last) or schedule.rank_of(0) == schedule.rank_of(last):
        return 0.0
    return shared_table_parameters(cost.spec, cost.mesh.tp) * GRAD_DTYPE_BYTES[cost.grad_dtype]


def reduction_time(kind: str, nbytes: float, time: Callable[[str, float], float]) -> float:
    """Seconds of collective ``kind`` of ``nbytes``: Σ ``time(kind, bytes)`` over
    :func:`reduction_parts` (the calls one after the other)."""
    return sum(time(k, b) for k, b in reduction_parts(kind, nbytes))


def reduction_bytes(
    mode: str, grad_dtype: str, dtype: str = "bf16", gather_overlapped: bool = False
) -> Reduction:
    """Bytes per parameter of the step's data-parallel gradient traffic, as a :class:`Reduction` of
    :func:`reduction_calls`: R for a plain all-reduce (``none``); (R + 2)/2 for the reduce-scatter of R
    and the all-gather of the 2-byte parameters (``zero1``, ``fsdp``: each moves (d − 1)/d of its bytes
    per rank, an all-reduce 2(d − 1)/d); R/2 for ``zero1`` with ``gather_overlapped``."""
    return Reduction.of(reduction_calls(mode, grad_dtype, dtype, gather_overlapped))


def exposed(comm: float, compute: float) -> float:
    """Seconds of communication ``comm`` not hidden behind ``compute`` it overlaps: max(0, comm − compute)."""
    return max(0.0, comm - compute)
