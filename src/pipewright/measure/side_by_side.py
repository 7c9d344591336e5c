"""The measured program next to the simulator, per distinct rank: peak memory (static part, activations
part, total), FLOPs per action kind, the bytes of one boundary message and over the data-parallel
groups (the gradients' reduction and the step's loss and norm scalars, against the simulator's
REDUCE_GRAD messages and :func:`~pipewright.cost.sharding.step_scalar_bytes`), each with the
difference (simulated / measured − 1), the tensor-, context- and expert-parallel collectives' bytes
(:mod:`.collective_bytes`: each collective's buffer, an all-reduce as its two halves) and whether it
meets the targets:
memory within 5 %, FLOPs within 1 %, bytes equal.

Static = parameters + gradients + optimizer state + buffers (measured) against weights + gradients +
optimizer state + embedding/output layer (+ the optimizer step's fp32 gradient copies where the step is
the simulated peak); activations = the rest of the peak against activations + recomputation transient
+ communication buffers (+ an asynchronous policy's weight versions in flight). The allocator's reserve
(what the caching allocator holds beyond live tensors, which meta tensors do not model) is stated
apart, the simulator's estimate of it, and is in neither total."""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.measure import collective_bytes
from pipewright.measure.rank import RankMeasure
from pipewright.measure.simulated_side import RankPrediction

MEMORY_TARGET = 0.05
FLOPS_TARGET = 0.01
GiB = 2**30
#: the rows compared in bytes, exactly
_BYTES = ("boundary message", "dp bytes", "tp bytes", "cp bytes", "ep bytes", "tied bytes")

_STATIC_MEASURED = ("params", "grads", "optimizer", "buffers")
_STATIC_SIMULATED = (
    "weights",
    "gradients",
    "optimizer_state",
    "embedding_output_layer",
    "step_gradients",
    "state",  # a wrapping cost model's state in one (measure/simulated_side.py's _lumped)
    "kfac_state",  # K-FAC's factors and inverses (measure/kfac_side.py)
)
_GRAD_GROUPS = ("dp", "expert-dp")
_ACTIVE_SIMULATED = ("activations", "recompute_transient", "communication_buffers", "weight_versions")


def _rel(sim: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if sim == 0 else float("inf")
    return sim / measured - 1.0


@dataclass(frozen=True)
class RankComparison:
    """One distinct rank, measured and simulated."""

    measured: RankMeasure
    predicted: RankPrediction
    boundary_bytes: int  # the largest single send the rank made (one boundary message)

    def rows(self) -> dict[str, tuple[float, float]]:
        """name → (measured, simulated), bytes or FLOPs."""
        m, p = self.measured, self.predicted
        static_m = sum(m.peak_parts[k] for k in _STATIC_MEASURED)
        static_p = sum(p.parts.get(k, 0.0) for k in _STATIC_SIMULATED)
        out = {
            "peak memory": (float(m.peak_bytes), p.peak_bytes),
            "  static": (float(static_m), static_p),
            "  activations": (
                float(m.peak_bytes - static_m),
                sum(p.parts.get(k, 0.0) for k in _ACTIVE_SIMULATED),
            ),
        }
        for kind in sorted(set(m.flops) | set(p.flops)):
            if kind != "step":
                out[f"FLOPs {kind}"] = (float(m.flops.get(kind, 0)), float(p.flops.get(kind, 0.0)))
        if self.boundary_bytes or p.message_bytes:
            out["boundary message"] = (float(self.boundary_bytes), p.message_bytes)
        # the dense gradients, the loss and the norm over dp, the experts' over their own dp group; an
        # all-reduce over cp: the loss's mean over the cp ranks, and at dp = 1 the gradients (dp × cp)
        dp = sum(
            v
            for (op, group), v in m.comm.items()
            if group in _GRAD_GROUPS or (op, group) == ("all_reduce", "cp")
        )
        if dp or p.reduce_bytes:
            out["dp bytes"] = (float(dp), p.reduce_bytes)
        # the tensor-, context- and expert-parallel collectives' buffers (.collective_bytes)
        groups = collective_bytes.measured(m.comm)
        for group in collective_bytes.GROUPS:
            meas, sim = groups.get(group, 0.0), p.collective_bytes.get(group, 0.0)
            if meas or sim:
                out[f"{group} bytes"] = (float(meas), float(sim))
        return out

    def misses(self) -> list[str]:
        """The rows outside their target."""
        out = []
        for name, (meas, sim) in self.rows().items():
            diff = abs(_rel(sim, meas))
            memory = name == "peak memory" and diff > MEMORY_TARGET
            flops = name.startswith("FLOPs") and diff > FLOPS_TARGET
            message = name in _BYTES and meas != sim
            if memory or flops or message:
                out.append(name)
        return out

    def as_dict(self) -> dict:
        m = self.measured
        return {
            "rank": m.rank,
            "pp_rank": m.pp_rank,
            "stages": list(m.stages),
            "peak_action": m.peak_action,
            "peak_parts_bytes": m.peak_parts,
            "simulated_parts_bytes": self.predicted.parts,
            "rows": {k: {"measured": a, "simulated": b} for k, (a, b) in self.rows().items()},
            "comm_bytes": {f"{op} {group}": v for (op, group), v in sorted(m.comm.items())},
            "comm_count": {f"{op} {group}": v for (op, group), v in sorted(m.comm_count.items())},
            "misses": self.misses(),
            "seconds": m.seconds,
        }


def compare(measured: RankMeasure, predicted: RankPrediction) -> RankComparison:
    sends = [  # not the context-parallel ring's
        v / max(1, measured.comm_count.get(key, 1))
        for key, v in measured.comm.items()
        if key[0] == "send" and key[1] != "cp"
    ]
    return RankComparison(measured, predicted, int(max(sends, default=0)))


def _fmt(name: str, value: float) -> str:
    if name.startswith("FLOPs"):
        return f"{value / 1e12:.2f} TF"
    if name in _BYTES[:2]:
        return f"{value / 2**20:.1f} MiB"
    if name in _BYTES:
        return f"{value / 1e9:.3f} GB"
    return f"{value / GiB:.2f} GiB"


def text(comparisons: list[RankComparison]) -> str:
    """Side-by-side text: per rank its measured and simulated rows, the difference and the misses."""
    lines = []
    for cmp in comparisons:
        m = cmp.measured
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.peak_parts.items() if v)
        lines.append(
            f"rank {m.rank} (pp {m.pp_rank}, stages {','.join(map(str, m.stages))}): peak at {m.peak_action} "
            f"[{parts} GiB]; measured in {m.seconds:.1f} s"
        )
        lines.append(f"  {'':20}{'measured':>14}{'simulated':>14}{'diff':>9}")
        for name, (meas, sim) in cmp.rows().items():
            lines.append(f"  {name:20}{_fmt(name, meas):>14}{_fmt(name, sim):>14}{_rel(sim, meas):>+9.1%}")
        reserve = cmp.predicted.parts.get("allocator_reserve")
        if reserve:
            lines.append(
                f"  allocator reserve (simulator's estimate, in neither peak): {reserve / GiB:.2f} GiB"
            )
        limit = cmp.predicted.memory_limit
        if limit:
            need = m.peak_bytes + (reserve or 0.0)
            verdict = "fits" if need <= limit else "does not fit"
            lines.append(
                f"  measured peak + reserve {need / GiB:.2f} GiB {verdict} the "
                f"{limit / GiB:.2f} GiB per device"
            )
        comm = ", ".join(f"{op} {group} {v / 2**20:.1f} MiB" for (op, group), v in sorted(m.comm.items()))
        lines.append(f"  bytes: {comm}")
        miss = cmp.misses()
        lines.append(f"  outside the targets: {', '.join(miss)}" if miss else "  within the targets")
    return "\n".join(lines)
