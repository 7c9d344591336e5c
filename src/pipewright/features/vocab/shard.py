"""The vocabulary-parallel layers on one shard: pure functions, no communication.

The vocabulary (V rows of the embedding and of the output weight) is padded to a multiple of the
number of shards P = p·t and split into P contiguous blocks of V_p = ⌈V/P⌉ rows; shard
``q = pp_rank · t + tp_rank`` holds rows ``[q·V_p, (q+1)·V_p)``. Rows past V are padding: zero in the
embedding, masked to −∞ in the logits, so they change nothing.

Output layer and cross-entropy (Yeung et al. 2024, §3-4), for tokens n with hidden state x_n and label
y_n, shard weight W_q (V_p × h):

- pass **S** (forward): z = x·W_qᵀ; local max m_q = max_j z_j; local Σexp s_q = Σ_j e^(z_j − m_q); the
  target logit z_y when y falls in the shard (0 otherwise). Algorithm 2 also computes the partial input
  gradient pieces softmax_q·W_q and W_q[y] (zero when y is foreign).
- **merge** (the online softmax over shards): M = max_q m_q, S = Σ_q s_q·e^(m_q − M);
  loss_n = log S + M − z_y. The shard's share of the softmax mass is α_q = s_q·e^(m_q − M) / S.
- pass **T** (backward): dZ = (α_q·softmax_q − onehot_q)·dℓ; ∇W_q = dZᵀ·x; Algorithm 1 also the partial
  ∇x = dZ·W_q (summed over shards afterwards). In Algorithm 2 ∇x = dℓ·Σ_q (α_q·softmax_q·W_q − W_q[y]),
  rescaled after the merge, so T computes ∇W only.

The input embedding: each shard looks up the ids it holds (zeros for foreign ids); the sum over shards is
the embedding output. Backward: each shard scatters the output gradient into its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


def padded_vocab(vocab: int, shards: int) -> int:
    """V rounded up to a multiple of the number of shards (p·t)."""
    return -(-vocab // shards) * shards


def shard_rows(vocab: int, shards: int) -> int:
    """V_p = padded V / P: rows per shard."""
    return padded_vocab(vocab, shards) // shards


def shard_index(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The shard a (pipeline, tensor) rank holds: pp_rank · t + tp_rank."""
    return pp_rank * tp_size + tp_rank


def shard_range(vocab: int, shards: int, index: int) -> tuple[int, int, int]:
    """(start, end, valid): the shard's padded row range and how many of its rows are real (< V)."""
    rows = shard_rows(vocab, shards)
    start = index * rows
    valid = max(0, min(rows, vocab - start))
    return start, start + rows, valid


def split_weight(weight: Tensor, shards: int) -> list[Tensor]:
    """The P row blocks of a (V × h) weight, the last ones zero-padded (V padded to a multiple of P)."""
    vocab, hidden = weight.shape
    pad = padded_vocab(vocab, shards) - vocab
    full = torch.cat([weight, weight.new_zeros(pad, hidden)]) if pad else weight
    return [b.clone() for b in full.chunk(shards)]


# --------------------------------------------------------------------------- input embedding


def embedding_forward(ids: Tensor, weight: Tensor, start: int) -> Tensor:
    """Rows of ``weight`` (the shard starting at vocabulary row ``start``) for the ids it holds, zeros
    for the others. Summed over all shards this is the full embedding lookup."""
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    out = weight[local.clamp(0, weight.shape[0] - 1)]
    return out * mine.unsqueeze(-1).to(out.dtype)


def embedding_backward(ids: Tensor, grad_out: Tensor, start: int, rows: int) -> Tensor:
    """∇W of the shard: grad_out of each token added into the row of its id when the shard holds it."""
    local = (ids - start).reshape(-1)
    mine = (local >= 0) & (local < rows)
    grad = grad_out.new_zeros(rows, grad_out.shape[-1])
    grad.index_add_(0, local[mine], grad_out.reshape(-1, grad_out.shape[-1])[mine])
    return grad


# --------------------------------------------------------------------------- output layer


@dataclass
class Stats:
    """Per-token softmax statistics of one shard (or merged over all): max m, Σ e^(z − m), target z_y."""

    max: Tensor
    sumexp: Tensor
    target: Tensor

    def stacked(self) -> Tensor:
        """[3, n]: the tensor a barrier exchanges."""
        return torch.stack([self.max, self.sumexp, self.target])

    @classmethod
    def unstack(cls, t: Tensor) -> Stats:
        return cls(t[0], t[1], t[2])


@dataclass
class SResult:
    """What pass S leaves for T (and for the barrier).

    ``softmax``: e^(z − m_q)/s_q over the shard's columns (None in the chunked variant, recomputed in
    T). ``grad_pieces``: Algorithm 2's (softmax_q·W_q, W_q[y]), each [n, h], else None.
    """

    stats: Stats
    softmax: Tensor | None
    grad_pieces: tuple[Tensor, Tensor] | None


def _logits(x: Tensor, weight: Tensor, valid: int) -> Tensor:
    z = x @ weight.t()
    if valid < weight.shape[0]:
        z[:, valid:] = NEG_INF
    return z


def _target(z: Tensor, labels: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
    """(target logit or 0, mask of tokens whose label the shard holds, clamped local label index)."""
    local = labels - start
    mine = (local >= 0) & (local < z.shape[1])
    idx = local.clamp(0, z.shape[1] - 1)
    target = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
    return target, mine, idx


def _gather_rows(weight: Tensor, idx: Tensor, mine: Tensor) -> Tensor:
    return weight[idx] * mine.unsqueeze(-1).to(weight.dtype)


def s_pass(
    x: Tensor, weight: Tensor, labels: Tensor, start: int, valid: int, *, fused: bool, keep: bool = True
) -> SResult:
    """Pass S on one shard for tokens ``x`` [n, h] with ``labels`` [n] (global ids).

    ``fused``: Algorithm 2 — also the partial input-gradient pieces. ``keep=False`` (chunked variant):
    do not keep the [n × V_p] softmax; T recomputes it.
    """
    z = _logits(x, weight, valid)
    m = z.max(dim=1).values
    if valid == 0:  # a shard of padding only (tiny V, many shards): no softmax mass, m = −∞
        e, s = torch.zeros_like(z), torch.zeros_like(m)
    else:
        e = torch.exp(z - m.unsqueeze(1))
        s = e.sum(dim=1)
    target, mine, idx = _target(z, labels, start)
    softmax = e.div_(s.clamp_min(torch.finfo(s.dtype).tiny).unsqueeze(1))
    pieces = None
    if fused:
        pieces = (softmax @ weight, _gather_rows(weight, idx, mine))
    return SResult(Stats(m, s, target), softmax if keep else None, pieces)


def s_pass_chunked(
    x: Tensor, weight: Tensor, labels: Tensor, start: int, valid: int, *, fused: bool, chunk: int
) -> SResult:
    """Pass S processed ``chunk`` tokens at a time; the softmax is not kept (peak [chunk × V_p])."""
    parts = [
        s_pass(x[i : i + chunk], weight, labels[i : i + chunk], start, valid, fused=fused, keep=False)
        for i in range(0, x.shape[0], chunk)
    ]
    stats = Stats(*(torch.cat([getattr(p.stats, f) for p in parts]) for f in ("max", "sumexp", "target")))
    pieces = None
    if fused:
        pieces = (torch.cat([p.grad_pieces[0] for p in parts]), torch.cat([p.grad_pieces[1] for p in parts]))
    return SResult(stats, None, pieces)


def merge(stats: list[Stats]) -> Stats:
    """Online-softmax merge over shards: M = max m_q, S = Σ s_q·e^(m_q − M), target = Σ target_q."""
    m = torch.stack([s.max for s in stats]).amax(dim=0)
    total = sum(s.sumexp * torch.exp(s.max - m) for s in stats)
    target = sum(s.target for s in stats)
    return Stats(m, total, target)


def merge_stacked(gathered: Tensor) -> Stats:
    """:func:`merge` of a [P, 3, n] tensor (the all-gathered per-shard statistics)."""
    m = gathered[:, 0].amax(dim=0)
    total = (gathered[:, 1] * torch.exp(gathered[:, 0] - m)).sum(dim=0)
    return Stats(m, total, gathered[:, 2].sum(dim=0))


def loss_of(merged: Stats) -> Tensor:
    """Per-token cross-entropy log S + M − z_y."""
    return torch.log(merged.sumexp) + merged.max - merged.target


def alpha(local: Stats, merged: Stats) -> Tensor:
    """The shard's share of the softmax mass, α_q = s_q·e^(m_q − M) / S, per token."""
    return local.sumexp * torch.exp(local.max - merged.max) / merged.sumexp


def _grad_logits(softmax: Tensor, a: Tensor, labels: Tensor, start: int, dloss: Tensor) -> Tensor:
    """dZ = (α·softmax − onehot)·dℓ over the shard's columns."""
    d = softmax * a.unsqueeze(1)
    local = labels - start
    mine = (local >= 0) & (local < d.shape[1])
    rows = torch.nonzero(mine).squeeze(1)
    d[rows, local[rows]] -= 1.0
    return d * dloss.unsqueeze(1)


def t_pass(
    x: Tensor,
    weight: Tensor,
    labels: Tensor,
    start: int,
    valid: int,
    s: SResult,
    merged: Stats,
    dloss: Tensor,
    *,
    input_grad: bool,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Pass T: (∇W_q, partial ∇x or None). ``input_grad`` for Algorithm 1 and naive (summed over shards
    afterwards). With ``s.softmax`` None (chunked S) the logits are recomputed ``chunk`` tokens at a
    time."""
    a = alpha(s.stats, merged)
    if s.softmax is not None:
        dz = _grad_logits(s.softmax, a, labels, start, dloss)
        return dz.t() @ x, (dz @ weight if input_grad else None)
    n = x.shape[0]
    step = chunk or n
    grad_w = torch.zeros_like(weight)
    grad_x = torch.empty_like(x) if input_grad else None
    for i in range(0, n, step):
        sl = slice(i, i + step)
        z = _logits(x[sl], weight, valid)
        if valid == 0:
            softmax = torch.zeros_like(z)
        else:
            softmax = torch.exp(z - s.stats.max[sl].unsqueeze(1)).div_(s.stats.sumexp[sl].unsqueeze(1))
        dz = _grad_logits(softmax, a[sl], labels[sl], start, dloss[sl])
        grad_w += dz.t() @ x[sl]
        if grad_x is not None:
            grad_x[sl] = dz @ weight
    return grad_w, grad_x


def alg2_input_grad_piece(pieces: tuple[Tensor, Tensor], local: Stats, merged: Stats) -> Tensor:
    """Algorithm 2: the shard's term α_q·(softmax_q·W_q) − W_q[y] of ∇x / dℓ (summed over shards)."""
    softmax_w, target_w = pieces
    return softmax_w * alpha(local, merged).unsqueeze(1) - target_w


# --------------------------------------------------------------------------- naive (three barriers)


def naive_s_max(x: Tensor, weight: Tensor, valid: int) -> tuple[Tensor, Tensor]:
    """Naive step 1: logits and their local max (barrier 1 reduces the max)."""
    z = _logits(x, weight, valid)
    return z, z.max(dim=1).values


def naive_s_sum(z: Tensor, labels: Tensor, start: int, global_max: Tensor) -> tuple[Tensor, Stats]:
    """Naive step 2, after the global max: e^(z − M) (kept), its sum and the target (barrier 2 sums)."""
    e = torch.exp(z - global_max.unsqueeze(1))
    target, _, _ = _target(z, labels, start)
    return e, Stats(global_max, e.sum(dim=1), target)
