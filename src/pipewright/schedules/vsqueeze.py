"""Squeezing and reordering a V-shape block schedule (Qi et al., Pipeline Parallelism with Controllable
Memory, NeurIPS 2024, §3: building block → repeating → squeezing → reordering).

A block schedule puts pass k of microbatch j of rank r at slot ``offset[r][k] + 6j`` (one slot per chunk
pass). Repeating the block leaves idle slots between the warm-up and the steady state and in the
cool-down, which is why the unsqueezed V-Half's bubble is about 0.6 of 1F1B's instead of ½. The paper
removes them without raising the peak activation memory (the peak sits in the steady state; warm-up and
cool-down have room to spare). Its reference code (sail-sg/zero-bubble, ``zbv_greedy.py``) does this by
a greedy pass we follow here:

1. place the weight-gradient passes (W) lazily into free slots after their backward;
2. walk every pass in slot order (all ranks together) and, in the warm-up (before rank 0's first I0)
   and in the cool-down (after the last microbatch's first F0), move it to the earliest free slot on its
   rank that is after its dependencies, whenever the rank's peak stays ≤ the cap; the steady state keeps
   its block slots;
3. compact (every pass as early as its dependencies and its rank's order allow, one slot each);
4. drop the W, repeat step 2 for the cool-down with the W placed lazily, place them (as in 1) and
   compact again;
5. drop the W once more and place them lazily per chunk — a rank's c1 W first, as in the reference.

The cap is the block schedule's peak over all ranks (so a rank below it may rise to it). Two details
matter: the dependencies are read from slots already moved (a pass moves only after the passes it waits
for), and the memory check looks at the whole rank with the not-yet-visited passes still at their block
slots, so the steady state's peak is counted before anything moves in front of it. For m ≥ 2p the
result is the reference's order pass for pass (p ≤ 12 checked). With few microbatches (the last F0
before rank 0's first I0) the cool-down squeeze starts at that I0; the reference never starts it there
and is then up to 13 unit slots longer (p ≤ 14, m < 2p), slower than the block order for odd p, m ≤ p.

Pass types, per rank r with chunks c0 = stage r and c1 = stage 2p − 1 − r: 0 = F0, 1 = F1, 2 = I1,
3 = I0, 4 = W (either chunk; one per I, in I order). F adds one chunk-microbatch, W frees one.
"""

from __future__ import annotations

F0, F1, I1, I0, WW = range(5)
_MEMORY = (1, 1, 0, 0, -1)

#: slots[rank][type][microbatch] → slot
Slots = list[list[list[int]]]


def _with_lazy_w(rank: list[list[int]]) -> list[list[int]]:
    """The rank's four pass lists plus a W list: each W in the first free slot after an I still owed one."""
    taken = {t: k for k in range(4) for t in rank[k]}
    owed, ws, t, end = 0, [], 0, max(taken)
    while t <= end or owed:
        if t in taken:
            owed += taken[t] in (I1, I0)
        elif owed:
            ws.append(t)
            owed -= 1
        t += 1
    return [list(x) for x in rank[:4]] + [ws]


def _peak(rank: list[list[int]], lazy_w: bool) -> int:
    """Most chunk-microbatches alive at once on a rank; with ``lazy_w`` the W are implicit (each free slot
    runs one owed W), otherwise they are the fifth list."""
    taken = {t: k for k in range(len(rank)) for t in rank[k]}
    live = peak = owed = 0
    for t in range(max(taken) + 1):
        if t in taken:
            live += _MEMORY[taken[t]]
            owed += taken[t] in (I1, I0)
        elif lazy_w and owed:
            live -= 1
            owed -= 1
        if live > peak:
            peak = live
    return peak


def _events(slots: Slots) -> list[tuple[int, int, int, int]]:
    """Every pass as (slot, rank, type, microbatch), in slot order (ties: lower rank, then type)."""
    return sorted(
        (t, r, k, j) for r, rank in enumerate(slots) for k, ts in enumerate(rank) for j, t in enumerate(ts)
    )


def _waits_for(slots: Slots, r: int, k: int, j: int) -> list[tuple[int, int, int]]:
    """The passes (rank, type, microbatch) that pass (r, k, j) depends on: the same pass one rank up- or
    downstream (F0 and I1 flow to higher ranks, F1 and I0 to lower ones), the previous pass of the block
    on the rank (F0 → F1 → I1 → I0) and the same stream's previous microbatch. (The j-th W also waits
    for the j-th I of its rank, which its place in the rank's order already ensures.)"""
    before = [(r, k, j - 1)] if j > 0 else []
    if k in (F0, I1) and r > 0:
        before.append((r - 1, k, j))
    if k in (F1, I0) and r < len(slots) - 1:
        before.append((r + 1, k, j))
    if F0 < k < WW:
        before.append((r, k - 1, j))
    return before


def _compact(slots: Slots) -> Slots:
    """Each pass one slot long, as early as its dependencies and its rank's order allow."""
    end: dict[tuple[int, int, int], int] = {}
    last: list[tuple[int, int, int] | None] = [None] * len(slots)
    for _, r, k, j in _events(slots):
        before = _waits_for(slots, r, k, j) + ([prev] if (prev := last[r]) is not None else [])
        end[(r, k, j)] = max((end[x] for x in before), default=0) + 1
        last[r] = (r, k, j)
    return [
        [[end[(r, k, j)] - 1 for j in range(len(ts))] for k, ts in enumerate(rank)]
        for r, rank in enumerate(slots)
    ]


def _squeeze(slots: Slots, m: int, warm_up: bool) -> Slots:
    """Step 2 above, in place: move warm-up (if ``warm_up``) and cool-down passes to earlier free slots
    under the cap. With five lists per rank the W are explicit, with four they are placed lazily."""
    lazy_w = len(slots[0]) == 4
    cap = max(_peak(rank, lazy_w) for rank in slots)
    taken: list[set[int]] = [set() for _ in slots]
    phase, seen_last_f0 = "warm-up", False
    for t, r, k, j in _events(slots):
        if phase == "warm-up" and (r, k) == (0, I0):
            phase = "cool-down" if seen_last_f0 else "steady"
        if k == F0 and j == m - 1:
            seen_last_f0 = True
            if phase == "steady":
                taken[r].add(t)
                phase = "cool-down"
                continue
        if phase == "steady" or (phase == "warm-up" and not warm_up):
            taken[r].add(t)
            continue
        rank = slots[r]
        before = [slots[x][y][z] for x, y, z in _waits_for(slots, r, k, j)]
        if k == WW:
            before.append(sorted(rank[I1] + rank[I0])[j])
        earliest = max(before, default=-1) + 1
        # with explicit W only an earlier F can raise the peak (an I holds nothing, an earlier W frees)
        check = lazy_w or k in (F0, F1)
        for s in range(earliest, t):
            if s not in taken[r]:
                rank[k][j] = s
                if not check or _peak(rank, lazy_w) <= cap:
                    break
        else:
            rank[k][j] = t
        taken[r].add(rank[k][j])
    return slots


def squeeze(offsets: list[tuple[int, int, int, int]], m: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's order after squeezing and reordering the block schedule whose microbatch 0 sits at
    ``offsets[r]`` = slots of (F0, F1, I1, I0) on rank r (steps 1–5 above).

    Returns per rank a list of (type, microbatch, chunk) with type in F0, F1, I1, I0, WW and chunk 0 or
    1 (a W's chunk is that of the I it follows: c1's owed W first, then c0's, oldest first).
    """
    slots: Slots = [[list(range(o, o + 6 * m, 6)) for o in offs] for offs in offsets]
    slots = _compact(_squeeze([_with_lazy_w(rank) for rank in slots], m, warm_up=True))
    slots = _squeeze([rank[:4] for rank in slots], m, warm_up=False)
    slots = _compact([_with_lazy_w(rank) for rank in slots])
    orders = []
    for rank in (rank[:4] for rank in slots):
        taken = {t: (k, j) for k in range(4) for j, t in enumerate(rank[k])}
        owed: tuple[list[int], list[int]] = ([], [])  # microbatches owing a W on c1, on c0
        order: list[tuple[int, int, int]] = []
        t, end = 0, max(taken)
        while t <= end or owed[0] or owed[1]:
            if t in taken:
                k, j = taken[t]
                order.append((k, j, 0 if k in (F0, I0) else 1))
                if k in (I1, I0):
                    owed[k == I0].append(j)
            else:
                chunk = next((c for c in (1, 0) if owed[1 - c]), None)
                if chunk is not None:
                    order.append((WW, owed[1 - chunk].pop(0), chunk))
            t += 1
        orders.append(order)
    return orders
