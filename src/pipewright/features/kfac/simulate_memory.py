"""K-FAC's memory in ``pipewright simulate --fill kfac``: each rank's memory by parts with a ``kfac``
part, its peak and the fit check, for the text report and ``--json``.

The ``kfac`` part is what K-FAC adds to the rank's peak: the peak with K-FAC
(:meth:`~.rank_memory.KfacRank.peak`, the function ``train --dry-run --measure`` compares the measured
program with) less the plain schedule's simulated peak (its parts as ``simulate`` reports them,
:func:`~pipewright.cost.memory_parts.rank_memory_parts`). The fit check is the peak with K-FAC against
one device's memory."""

from __future__ import annotations

#: the part's key in ``memory_parts`` and its column in the table
PART, LABEL = "kfac", "K-FAC"


def memory_report(setup) -> dict | None:
    """``{"memory": {...}, "per_rank": [...]}`` in ``simulate --json``'s terms (``limit_bytes``,
    ``fits``, ``over_limit``, ``peak_bytes``; per rank ``peak_memory_bytes``, ``memory_parts`` and
    ``kfac``: factors and inverses, what it holds after the iteration, its step's KL-clip); None
    where the cost model has no memory parts (unit costs, a profile) or K-FAC's memory is not priced
    (a mixture of experts, a family without its covered layers listed)."""
    from pipewright.cost.memory_parts import rank_memory_parts, register_part, with_part
    from pipewright.features.kfac.rank_memory import kfac_ranks

    cost = setup.cost
    kfac = kfac_ranks(cost, setup.schedule)
    if not kfac:
        return None
    result = setup.simulate()
    sched = result.source
    parts = rank_memory_parts(cost, sched, [float(p) for p in result.peak_memory])
    if parts is None:
        return None
    register_part(PART, LABEL)
    per_rank = []
    for rank, plain in enumerate(result.peak_memory):
        k = kfac[rank]
        peak = k.peak(float(cost.static_bytes(rank, sched)))
        held = {"factors_inverses_bytes": k.state, "held_after_iteration_bytes": k.held, "step_bytes": k.step}
        row = with_part(parts[rank], PART, peak - float(plain))
        per_rank.append({"rank": rank, "peak_memory_bytes": peak, "memory_parts": row, PART: held})
    limit = setup.memory_limit
    over = [] if limit is None else [r["rank"] for r in per_rank if r["peak_memory_bytes"] > limit]
    memory = {
        "limit_bytes": limit,
        "fits": not over,
        "over_limit": over,
        "peak_bytes": max(r["peak_memory_bytes"] for r in per_rank),
    }
    return {"memory": memory, "per_rank": per_rank}


def memory_lines(report: dict) -> list[str]:
    """The text report: each rank's peak with K-FAC, the parts table and the fit verdict."""
    from pipewright.cost.memory_parts import memory_table

    gib = 2**30
    mem = report["memory"]
    lines = [f"{'rank':>4}  {'peak memory':>12}  (with K-FAC)"]
    lines += [f"{r['rank']:>4}  {r['peak_memory_bytes'] / gib:>8.2f} GiB" for r in report["per_rank"]]
    lines.append(memory_table([r["memory_parts"] for r in report["per_rank"]]))
    lines.append(
        "peak memory (the fit check) = total - comm bufs - reserve; K-FAC: what it adds to the peak "
        "(factors and inverses, the inputs and gradients kept for the bubbles, preconditioned gradients, "
        "the step's KL-clip)"
    )
    if not mem["fits"]:
        limit = mem["limit_bytes"] / gib
        lines.append(f"DOES NOT FIT: ranks {mem['over_limit']} exceed {limit:.2f} GiB per device")
    return lines


def no_fit(report: dict) -> str:
    """The one-line error of a layout that does not fit with K-FAC's memory."""
    mem = report["memory"]
    return (
        f"ranks {mem['over_limit']} do not fit {mem['limit_bytes'] / 2**30:.2f} GiB per device with "
        "K-FAC's memory; raise --pp or --tp, use a smaller --microbatch-size "
        "(or give --allow-no-fit to exit 0)"
    )
