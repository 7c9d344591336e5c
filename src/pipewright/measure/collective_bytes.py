"""The bytes of one step's tensor-, context- and expert-parallel collectives and a tied embedding's
all-reduce between the pipeline's two ends, per rank, on both sides of
the comparison, in one convention: a collective's **buffer** — an all-gather's output, a
reduce-scatter's input, an all-to-all's input, a send's tensor — and an all-reduce as its two halves,
a reduce-scatter and an all-gather of its buffer (2 × the buffer; what a ring all-reduce moves is
2(n − 1)/n of it, a ring all-gather or reduce-scatter (n − 1)/n). So sequence parallelism's all-gather
plus reduce-scatter and the all-reduce they replace state the same bytes.

Simulated (:func:`simulated`): the sizes the cost model prices time from, summed over the rank's
actions — ``tp``: each entry of the chunk's ``tp_bytes[kind]`` (what
:func:`~pipewright.cost.tp_overlap.chunk_pass` prices as tensor-parallel all-reduces) and the step's
(:func:`~pipewright.cost.sharding.tp_step_bytes`: the replicated parameters' gradients, Σ g²); ``cp``: the
layers × :func:`~pipewright.cost.context_parallel.cp_sent_bytes` (the bytes a rank sends round the
ring); ``ep``: :meth:`~pipewright.cost.moe_cost.MoECost.a2a_calls` × ``a2a_bytes``; ``tied``: each
stage's :func:`~pipewright.cost.sharding.tied_step_bytes` (the table's gradient). Measured
(:func:`measured`): the tracker's counts over the same groups (the ring's sends only; an
all-to-all's integer payload — the routing's tokens-per-expert exchange, which no cost model prices —
is counted apart, as ``all_to_all_counts``)."""

from __future__ import annotations

from collections import defaultdict

from pipewright.ir import B, F, I, W

#: the groups compared, in report order
GROUPS = ("tp", "cp", "ep", "tied")
#: an all-reduce states its reduce-scatter and all-gather halves: 2 buffers
_ALL_REDUCE = 2
#: per group, the measured ops compared → how many buffers each states. Over cp only the ring's
#: sends: an all-reduce over the cp group is the gradients' (the dp × cp replicas at dp 1)
_OPS = {
    "tp": {"all_reduce": _ALL_REDUCE, "all_gather": 1, "reduce_scatter": 1},
    "cp": {"send": 1},
    "ep": {"all_to_all": 1},
    "tied": {"all_reduce": _ALL_REDUCE},
}


def measured(comm: dict[tuple[str, str], int]) -> dict[str, float]:
    """Per group of :data:`GROUPS`: the buffer bytes of the measured ``comm`` ((op, group) → bytes)."""
    out: dict[str, float] = defaultdict(float)
    for (op, group), nbytes in comm.items():
        weight = _OPS.get(group, {}).get(op)
        if weight:
            out[group] += weight * nbytes
    return dict(out)


def simulated(cost, sched, rank: int) -> dict[str, float]:
    """Per group of :data:`GROUPS`: the buffer bytes the cost model prices on pipeline rank ``rank``
    of ``sched`` (module docstring); a wrapping cost model (vocabulary parallelism) is read through
    to the transformer's."""
    from pipewright.cost.context_parallel import cp_sent_bytes
    from pipewright.cost.sharding import tied_step_bytes, tp_step_bytes

    base = getattr(cost, "inner", cost)
    out: dict[str, float] = defaultdict(float)
    for stage in sched.stages_of(rank):
        out["tp"] += _ALL_REDUCE * sum(tp_step_bytes(base, stage, sched))
        out["tied"] += _ALL_REDUCE * tied_step_bytes(base, stage, sched)
    for action in sched.actions[rank]:
        if action.kind not in (F, B, I, W):
            continue
        chunk = base._chunk(action.stage, sched)
        if base.mesh.tp > 1:
            out["tp"] += _ALL_REDUCE * sum(chunk.tp_bytes[action.kind])
        if chunk.layers:
            out["cp"] += chunk.layers * cp_sent_bytes(base, action.kind)
        calls = getattr(base, "a2a_calls", None)
        if calls is not None:
            out["ep"] += calls(chunk, action.kind) * base.a2a_bytes()
    return {k: v for k, v in out.items() if v}
