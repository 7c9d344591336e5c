"""Path search over a topology's bonded adjacency (node → neighbour → (bandwidth, latency)).

The best path between two nodes is the widest one (largest bottleneck bandwidth), then the one with
fewest hops, then the one with least latency; time = Σ latency along it + bytes / bottleneck bandwidth.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: node → neighbour → (bonded bandwidth in bytes/s, lowest latency in s)
Adjacency = Mapping[str, Mapping[str, tuple[float, float]]]


@dataclass(frozen=True)
class PathInfo:
    """The best path between two nodes: bottleneck ``bandwidth``, total ``latency``, ``hops``."""

    bandwidth: float
    latency: float
    hops: int

    def time(self, nbytes: float) -> float:
        if self.hops == 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


def best_path(adj: Adjacency, src: str, dst: str) -> PathInfo | None:
    """Best path ``src`` → ``dst``: the widest bottleneck W first (widest-path Dijkstra), then fewest
    hops and least latency over links of bandwidth ≥ W. Both searches look at ``dst`` first when
    expanding a node and prune what cannot beat the best ``dst`` label found, so a search through a
    big switch does not push all of its ports."""
    width = {src: math.inf}
    heap: list[tuple[float, str]] = [(-math.inf, src)]
    done: set[str] = set()
    found = 0.0
    while heap:
        neg, u = heapq.heappop(heap)
        if u in done or -neg <= found:
            continue
        done.add(u)
        if u == dst:
            break
        direct = adj[u].get(dst)
        if direct is not None:
            found = max(found, min(-neg, direct[0]))
            if found == -neg:
                break  # nothing left in the heap is wider than u
        for v, (bw, _) in adj[u].items():
            w = min(-neg, bw)
            if w > found and v not in done and w > width.get(v, 0.0):
                width[v] = w
                heapq.heappush(heap, (-w, v))
    threshold = max(found, width.get(dst, 0.0) if dst in done else 0.0)
    if threshold == 0.0:
        return None
    best = {src: (0, 0.0)}
    queue: list[tuple[int, float, str]] = [(0, 0.0, src)]
    while queue:
        hops, lat, u = heapq.heappop(queue)
        if u == dst:
            return PathInfo(threshold, lat, hops)
        if (hops, lat) > best[u]:
            continue
        direct = adj[u].get(dst)
        candidate = (hops + 1, lat + direct[1]) if direct is not None and direct[0] >= threshold else None
        if candidate is not None and candidate < best.get(dst, (math.inf, math.inf)):
            best[dst] = candidate
            heapq.heappush(queue, (*candidate, dst))
        limit = best.get(dst, (math.inf, math.inf))[0]
        if hops + 1 >= limit:
            continue  # no neighbour can be on a path shorter than the best found (a big switch's ports)
        for v, (bw, l) in adj[u].items():
            if (
                bw >= threshold
                and hops + 1 < limit
                and (hops + 1, lat + l) < best.get(v, (math.inf, math.inf))
            ):
                best[v] = (hops + 1, lat + l)
                heapq.heappush(queue, (hops + 1, lat + l, v))
    raise AssertionError("a path of width W exists")  # pragma: no cover


def widest_off_host(adj: Adjacency, device: str, home: Callable[[str], str]) -> float:
    """Widest bottleneck from ``device`` to any node off its host, searching inside the host only."""
    host = home(device)
    width = {device: math.inf}
    heap: list[tuple[float, str]] = [(-math.inf, device)]
    best = 0.0
    while heap:
        neg, u = heapq.heappop(heap)
        if -neg < width[u]:
            continue
        for v, (bw, _) in adj[u].items():
            w = min(-neg, bw)
            if home(v) != host:
                best = max(best, w)
            elif w > width.get(v, 0.0):
                width[v] = w
                heapq.heappush(heap, (-w, v))
    return best
