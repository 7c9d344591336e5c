"""Contiguous layer partition minimising the bottleneck stage under a per-stage memory limit.

Stage i (pipeline rank i, on its own devices) holding layers [a, b) of a model with layer weights w
(1 for identical transformer layers) costs, per microbatch,

    T_i(a, b) = max(c_i · Σ_{k∈[a,b)} w_k + e_i, x_i)

with c_i the F + B seconds of one unit layer on stage i's devices, e_i the embedding (i = 0) and the
output layer + loss (i = p − 1) on those devices, and x_i the stage-boundary transfer to stage i + 1 on
the link it is mapped to (forward activation + backward gradient): the link is a resource of its own
whose transfers overlap compute (sends do not block in the simulator or the runtime), so a stage is a
bottleneck through its compute or through its link, whichever is busier. Its memory is

    M_i(a, b) = static_i(a, b) + k_i · activation_i(a, b) ≤ limit_i

with k_i the microbatches the schedule keeps in flight on rank i (``ScheduleInfo.memory``, i.e.
:func:`pipewright.ir.peak_in_flight` of the generated schedule).

:func:`dp_partition` solves min over partitions of max_i T_i exactly by dynamic programming,
best[i][j] = min_{a} max(best[i−1][a], T_i(a, j)), O(p·L²). :func:`bisect_partition` finds the same
optimum in O((p + L)·log(1/ε)): a greedy pass that gives each stage the longest prefix with T_i ≤ T and
M_i ≤ limit_i decides whether bottleneck T is feasible (an exchange argument: its stage ends are never
left of any feasible partition's, since T and M grow with the range), and bisection on T finds the
least feasible T. Ties are broken toward the smaller total Σ T_i (shorter fill and drain).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.plan.costs import StageCost


class DoesNotFitError(ConfigError):
    """No partition keeps every stage under its memory limit."""


@dataclass(frozen=True)
class StageTerms:
    """Stage i's coefficients: T = time_per_layer·w + fixed_time; M = static_per_layer·w + fixed_static
    + in_flight·act_per_layer·w + fixed_act."""

    time_per_layer: float
    fixed_time: float
    static_per_layer: float
    fixed_static: float
    act_per_layer: float
    fixed_act: float  # the embedding's / head's activations held at the peak (all microbatches), bytes,
    # and one layer's recomputation transient (a backward's, on top of them)
    in_flight: float
    memory_limit: float
    comm: float = 0.0  # the boundary link's busy time per microbatch (overlaps compute)

    def time(self, w: float) -> float:
        return max(self.time_per_layer * w + self.fixed_time, self.comm)

    def memory(self, w: float) -> float:
        return (
            self.static_per_layer * w
            + self.fixed_static
            + self.in_flight * self.act_per_layer * w
            + self.fixed_act
        )


def stage_terms(
    costs: Sequence[StageCost],
    comm: Sequence[float],
    in_flight: Sequence[float],
    limits: Sequence[float],
    ends: tuple[float, float] | None = None,
) -> list[StageTerms]:
    """Terms of p stages from their devices' :class:`StageCost`, the boundary transfer time to the
    next stage (0 for the last) and the schedule's microbatches in flight per rank; ``ends``: the
    microbatches whose embedding (first chunk) and output-layer (last chunk) activations the order
    holds at most (:func:`pipewright.plan.chunked.end_chunks_in_flight`; default the first and last
    ranks' in flight, as 1F1B holds them)."""
    p = len(costs)
    embeds, heads = ends if ends is not None else (in_flight[0], in_flight[-1])
    out = []
    for i, c in enumerate(costs):
        first, last = i == 0, i == p - 1
        out.append(
            StageTerms(
                c.layer,
                c.time(0, first, last),
                c.layer_static,
                c.memory(0, first, last, 0.0),
                c.layer_act,
                first * c.embed_act * embeds + last * c.head_act * heads + _transient(c, last),
                in_flight[i],
                limits[i],
                comm[i],
            )
        )
    return out


def _transient(c: StageCost, last: bool) -> float:
    """One layer's recomputation transient on top of the stage's peak; on the last stage less the
    output layer's activations, which its backward frees first (cost/chunk_memory.transient_bytes)."""
    return max(c.transient - c.head_act, 0.0) if last else c.transient


@dataclass(frozen=True)
class Partition:
    """Layers per stage, the bottleneck stage time and the sum of the stage times."""

    layers: tuple[int, ...]
    bottleneck: float
    total: float


def evaluate(terms: Sequence[StageTerms], layers: Sequence[int], weights: Sequence[float] | None = None):
    """(bottleneck, total, fits) of a given partition."""
    return _eval_w(terms, layers, _prefix(weights, sum(layers)))


def _prefix(weights: Sequence[float] | None, n: int) -> list[float]:
    ws = [1.0] * n if weights is None else list(weights)
    out = [0.0]
    for x in ws:
        out.append(out[-1] + x)
    return out


def dp_partition(
    terms: Sequence[StageTerms], num_layers: int, weights=None, min_layers: int = 1
) -> Partition:
    """Exact min-bottleneck partition by dynamic programming (module docstring), ≥ ``min_layers``
    layers per stage."""
    p, L, k = len(terms), num_layers, min_layers
    if p * k > L:
        raise ConfigError(f"{p} pipeline stages of ≥ {k} layers for {L} layers; use fewer stages")
    w = _prefix(weights, L)
    inf = (math.inf, math.inf)
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    arg = [[0] * (L + 1) for _ in range(p + 1)]
    best[0][0] = (0.0, 0.0)
    for i in range(1, p + 1):
        t = terms[i - 1]
        for j in range(i * k, L - (p - i) * k + 1):
            cur, at = inf, 0
            for a in range((i - 1) * k, j - k + 1):
                prev = best[i - 1][a]
                if prev[0] == math.inf:
                    continue
                x = w[j] - w[a]
                if t.memory(x) > t.memory_limit:
                    continue
                ti = t.time(x)
                cand = (max(prev[0], ti), prev[1] + ti)
                if cand < cur:
                    cur, at = cand, a
            best[i][j], arg[i][j] = cur, at
    if best[p][L][0] == math.inf:
        raise DoesNotFitError("no partition fits the memory limit")
    layers, j = [], L
    for i in range(p, 0, -1):
        a = arg[i][j]
        layers.append(j - a)
        j = a
    return Partition(tuple(reversed(layers)), *best[p][L])


def _fits(t: StageTerms, x: float, cap: float) -> bool:
    """Stage ``t`` with ``x`` layers' worth of work stays under the time ``cap`` and its memory limit."""
    return t.time(x) <= cap and t.memory(x) <= t.memory_limit


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest n in [lo, hi] with ``ok(n)``, by binary search (``ok`` monotone: true up to some n);
    None when ``ok(lo)`` is false."""
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _capacity(t: StageTerms, cap: float, L: int) -> int:
    """Identical layers: the most layers x ∈ [0, L] stage ``t`` holds with :func:`_fits` (time ≤ ``cap``,
    memory ≤ its limit), −1 if none; the linear bounds solved in closed form, then nudged so the
    answer is exactly what :func:`_fits` says (rounding)."""
    if t.comm > cap:
        return -1
    hi = L
    for per, fixed, limit in (
        (t.time_per_layer, t.fixed_time, cap),
        (t.static_per_layer + t.in_flight * t.act_per_layer, t.memory(0), t.memory_limit),
    ):
        if per > 0:
            room = (limit - fixed) / per
            hi = min(hi, math.floor(room) if room < L else L)
        elif fixed > limit:
            return -1
    x = max(hi, -1)
    while x < L and _fits(t, x + 1, cap):
        x += 1
    while x >= 0 and not _fits(t, x, cap):
        x -= 1
    return x


def _capacities(terms, cap: float, L: int) -> list[int]:
    """:func:`_capacity` of every stage, computed once per distinct stage (stages on like devices
    share their terms)."""
    memo: dict[StageTerms, int] = {}
    out = []
    for t in terms:
        x = memo.get(t)
        if x is None:
            x = memo[t] = _capacity(t, cap, L)
        out.append(x)
    return out


def _greedy_identical(caps: Sequence[int], L: int, k: int = 1) -> list[int] | None:
    """:func:`_greedy` for identical layers from the stages' capacities: stage i takes
    min(cap_i, what leaves k layers to each later stage), O(p)."""
    p, out, pos = len(caps), [], 0
    for i, c in enumerate(caps):
        x = min(c, L - (p - i - 1) * k - pos)
        if x < k:
            return None
        out.append(x)
        pos += x
    return out if pos == L else None


def _greedy(terms, w: list[float], cap: float, k: int = 1) -> list[int] | None:
    """Longest prefixes (≥ k layers) with time ≤ cap and memory within limits; None if infeasible."""
    p, L = len(terms), len(w) - 1
    out, pos = [], 0
    for i, t in enumerate(terms):
        rest = p - i - 1
        hi = L - rest * k
        # the largest end e in [pos + k, hi] whose range fits: binary search (time and memory monotone)
        ok = _largest(pos + k, hi, lambda e, t=t, pos=pos: _fits(t, w[e] - w[pos], cap))
        if ok is None:
            return None
        if not rest and ok != L:
            return None
        out.append(ok - pos)
        pos = ok
    return out


def fits_somewhere(terms: Sequence[StageTerms], num_layers: int, min_layers: int = 1) -> bool:
    """Whether some partition of identical layers (≥ ``min_layers`` per stage) keeps every stage under
    its memory limit: the greedy pass with no time cap (module docstring), O(p·log L)."""
    if len(terms) * min_layers > num_layers:
        return False
    caps = _capacities(terms, math.inf, num_layers)
    return _greedy_identical(caps, num_layers, min_layers) is not None


def _least_identical(terms: Sequence[StageTerms], L: int, k: int) -> float:
    """Identical layers: the least feasible bottleneck T. It is one of the stage times T_i(x), x ∈ [k, L]
    (the bottleneck of the optimal partition is some stage's time), so a binary search over those
    values, sorted, with the closed-form feasibility check (capacities per distinct stage, O(p)) finds it
    exactly in O(log(p·L)) checks."""
    uniq = list(dict.fromkeys(terms))
    where = {t: n for n, t in enumerate(uniq)}
    index = [where[t] for t in terms]

    def feasible(cap: float) -> bool:
        caps = [_capacity(u, cap, L) for u in uniq]
        return _greedy_identical([caps[n] for n in index], L, k) is not None

    values = sorted(
        {
            max(u.time_per_layer * x + u.fixed_time, u.comm)  # StageTerms.time, inlined
            for u in uniq
            for x in range(k, max(k, _capacity(u, math.inf, L)) + 1)  # x the stage's memory holds
        }
    )
    if not feasible(values[-1]):
        raise DoesNotFitError("no partition fits the memory limit")
    lo, hi = 0, len(values) - 1  # values[hi] feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return values[hi]


def bisect_partition(
    terms: Sequence[StageTerms], num_layers: int, weights=None, min_layers: int = 1
) -> Partition:
    """The min-bottleneck partition by greedy feasibility and bisection on T (module docstring). With
    identical layers (``weights`` None) the slack under the optimal T is then spread over the stages in
    proportion to their capacity, so no stage is left needlessly light."""
    p, L, k = len(terms), num_layers, min_layers
    if p * k > L:
        raise ConfigError(f"{p} pipeline stages of ≥ {k} layers for {L} layers; use fewer stages")
    w = _prefix(weights, L)
    if weights is None:
        hi = _least_identical(terms, L, k)
        greedy = None
    else:

        def greedy(cap: float) -> list[int] | None:
            return _greedy(terms, w, cap, k)

        hi = max(t.time(w[L]) for t in terms)
        if greedy(hi) is None:
            raise DoesNotFitError("no partition fits the memory limit")
        lo = 0.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if greedy(mid) is None:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-9 * hi:
                break
    layers = greedy(hi) if greedy is not None else _greedy_identical(_capacities(terms, hi, L), L, k)
    if weights is None:
        layers = _spread(terms, L, hi, k) or layers
    layers = _balance_tail(terms, w, layers, k)
    bottleneck, total, _ = evaluate(terms, layers, weights)
    return Partition(tuple(layers), bottleneck, total)


def _spread(terms, L: int, cap: float, k: int) -> list[int] | None:
    """Identical layers: capacity c_i = the most layers stage i takes under ``cap`` and its memory; give
    each stage ⌊L·c_i/Σc⌋ (≥ k) and the remainder to the stages with the largest fractional parts."""
    caps = _capacities(terms, cap, L)
    if min(caps) < k:
        return None
    total = sum(caps)
    if total < L:
        return None
    share = [L * c / total for c in caps]
    layers = [max(k, min(c, math.floor(x))) for c, x in zip(caps, share, strict=True)]
    order = sorted(range(len(terms)), key=lambda i: layers[i] - share[i])
    while sum(layers) < L:
        for i in order:
            if sum(layers) < L and layers[i] < caps[i]:
                layers[i] += 1
    while sum(layers) > L:
        for i in reversed(order):
            if sum(layers) > L and layers[i] > k:
                layers[i] -= 1
    return layers


def _balance_tail(terms, w, layers: list[int], k: int = 1) -> list[int]:
    """The greedy pass leaves the last stages light; move layers backwards one at a time while the
    bottleneck does not grow and the total shrinks (a cheap tie-break toward a shorter fill/drain)."""
    layers = list(layers)
    starts = [0]
    for n in layers:
        starts.append(starts[-1] + n)
    spans = list(zip(terms, starts[:-1], starts[1:], strict=True))
    times = [t.time(w[b] - w[a]) for t, a, b in spans]
    over = [t.memory(w[b] - w[a]) > t.memory_limit for t, a, b in spans]
    bottleneck, total, bad = max(times), sum(times), sum(over)
    improved = True
    while improved:
        improved = False
        for i in range(len(layers) - 1):
            if layers[i] <= k:
                continue
            # moving stage i's last layer to stage i + 1 changes only their two ranges; the others
            # are at most the bottleneck, so only the two new times can raise it
            cut = starts[i + 1] - 1
            ti, tj = terms[i], terms[i + 1]
            xi, xj = w[cut] - w[starts[i]], w[starts[i + 2]] - w[cut]
            new_i, new_j = ti.time(xi), tj.time(xj)
            trial_times = [*times[:i], new_i, new_j, *times[i + 2 :]]
            tot = sum(trial_times)  # summed in order, as a fresh evaluation would (ties: 1e-15)
            over_i, over_j = ti.memory(xi) > ti.memory_limit, tj.memory(xj) > tj.memory_limit
            trial_bad = bad - over[i] - over[i + 1] + over_i + over_j
            cap = bottleneck * (1 + 1e-12)
            if trial_bad == 0 and new_i <= cap and new_j <= cap and tot < total - 1e-15:
                layers[i] -= 1
                layers[i + 1] += 1
                starts[i + 1] = cut
                times = trial_times
                over[i], over[i + 1] = over_i, over_j
                bottleneck, total, bad, improved = max(times), tot, trial_bad, True
    return layers


def _eval_w(terms, layers, w):
    pos, times, fits = 0, [], True
    for t, n in zip(terms, layers, strict=True):
        x = w[pos + n] - w[pos]
        times.append(t.time(x))
        fits &= t.memory(x) <= t.memory_limit
        pos += n
    return max(times), sum(times), fits


def partition(terms: Sequence[StageTerms], num_layers: int, weights=None, min_layers: int = 1) -> Partition:
    """The min-bottleneck partition: exact DP for small instances, bisection otherwise (same optimum)."""
    if len(terms) * num_layers * num_layers <= 20_000:
        return dp_partition(terms, num_layers, weights, min_layers)
    return bisect_partition(terms, num_layers, weights, min_layers)


def chunk_layout(rank_layers: Sequence[int], virtual: int) -> tuple[int, ...]:
    """Layers per chunk (stage c = k·p + r on rank r) from layers per rank: each rank's layers split
    over its v chunks as evenly as possible (later chunks get the remainder, so the last chunk of the
    last rank, which holds the head, is not the lighter one)."""
    p = len(rank_layers)
    out = [0] * (p * virtual)
    for r, n in enumerate(rank_layers):
        if n < virtual:
            raise ConfigError(f"rank {r} has {n} layers for {virtual} chunks; lower --virtual")
        q, rem = divmod(n, virtual)
        for k in range(virtual):
            out[k * p + r] = q + (k >= virtual - rem)
    return tuple(out)


def layout_string(chunk_layers: Sequence[int]) -> str:
    """The ``--layout`` string (models/layout.py) of layers per chunk: ``Et*3|t*4|t*3L``."""
    parts = []
    n = len(chunk_layers)
    for c, k in enumerate(chunk_layers):
        body = "" if k == 0 else ("t" if k == 1 else f"t*{k}")
        parts.append(("E" if c == 0 else "") + body + ("L" if c == n - 1 else ""))
    return "|".join(parts)
