"""Ring attention over a context-parallel group, with causal load balancing.

Layout (Megatron-LM's / Liu et al.'s "striped" zig-zag): the sequence of length S is cut into 2·cp
chunks of c = S/(2·cp) tokens; context-parallel rank r holds chunks r and 2·cp−1−r, in that order. The
global positions of a rank's 2c tokens increase along its local sequence, so a causal mask over local
indices is the causal mask over global positions.

Forward (Liu et al., 2023, "Ring Attention with Blockwise Transformers"): every rank keeps its queries
and passes its key/value block to the next rank of the ring, cp − 1 times. At step i rank r holds the
block of rank j = (r − i) mod cp; the isend/irecv of that block to/from the neighbours is started before
the block is used, so the exchange runs while the rank computes. Each step gives a partial output O_j and
its log-sum-exp L_j = log Σ_k exp(s_k) per query row; partials merge exactly:

    L = log(e^{L_a} + e^{L_b}),   O = e^{L_a − L}·O_a + e^{L_b − L}·O_b.

Which part of a block a rank needs (chunk order c_r < c_j for j > r ...): for j = r, the causal local
block; for j < r, all queries against chunk j only (chunk 2·cp−1−j lies after every local query); for
j > r, the second local chunk's queries against the whole block (the first lies before all of it). Every
rank so does the same work, 2c² key-query pairs per off-diagonal step (load balancing).

Backward: with the final O and L, each block's P = exp(S − L) is recomputed and

    dV = Pᵀ dO,  dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)),  dQ = dS K / √d,  dK = dSᵀ Q / √d;

the key/value blocks go round the ring again (each exchange started before the block it overlaps is
computed, as in the forward). The diagonal block's dK/dV stays home; every other block's dK/dV
accumulator starts at the block's first visit after home and travels after it, one step behind, so
that after cp steps it arrives home with every rank's contribution: cp − 1 transfers of the
accumulator, each started when a block's contribution is added and waited only when the next block's
has been computed (double buffering, as in Transformer Engine's ring): during block i the rank has in
flight the key/value block of step i + 1 and the accumulator of step i − 1, and only the last
accumulator, the one coming home after the last block, is waited with no block computation behind it.

:class:`DistRing` counts, per direction, the exchanges posted and those waited with no block computed
on that direction since they were posted (``exposed``), and the seconds spent waiting (``waited``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from pipewright.models.blocks import AttentionCore
from pipewright.runtime.profiling.wait_clock import WaitClock


class Pending(Protocol):
    def wait(self) -> torch.Tensor: ...


class Ring(Protocol):
    """A context-parallel ring: ``rank`` of ``size``; :meth:`exchange` sends a tensor to the next rank
    and receives the previous rank's (same shape), asynchronously; ``backward``: an exchange of the
    backward pass (which may run at the same time as a forward's, :mod:`.overlap`). A ring may also
    define ``note_block(backward)``, called after each block computation (:func:`_note_block`)."""

    rank: int
    size: int

    def exchange(self, tensor: torch.Tensor, backward: bool = False) -> Pending: ...


def _note_block(ring: Ring, backward: bool) -> None:
    """Tell ``ring`` that a block of the ``backward`` (or forward) pass was computed, if it counts them."""
    note = getattr(ring, "note_block", None)
    if note is not None:
        note(backward)


class _Received:
    def __init__(self, works: list, buffer: torch.Tensor, ring: DistRing, backward: bool) -> None:
        self.works, self.buffer, self.ring, self.backward = works, buffer, ring, backward
        self.blocks_at_post = ring.blocks[backward]

    def wait(self) -> torch.Tensor:
        ring, backward = self.ring, self.backward
        if ring.blocks[backward] == self.blocks_at_post:
            ring.exposed[backward] += 1  # no block computed behind this exchange
        with ring.waited.timing(backward, self.buffer.device):
            for work in self.works:
                work.wait()
        return self.buffer


class DistRing:
    """The ring over torch.distributed groups: ring rank ``rank`` of ``size`` sends to the process
    ``next`` (ring rank + 1) and receives from ``prev`` (ring rank − 1), global ranks, both posted
    together (``batch_isend_irecv``: no send waits for the other rank's receive). The backward's
    exchanges go over ``back_group`` (the same ranks; default ``group``), so that a forward and a
    backward running at once never match each other's messages.

    Counters by direction (False: forward, True: backward; each direction runs on one thread at a
    time): ``exchanges`` posted, ``blocks`` computed, ``exposed``: exchanges waited with no block
    computed since they were posted, ``waited``: seconds spent waiting (exposed communication; on
    CUDA the stream's wait, :class:`~pipewright.runtime.profiling.wait_clock.WaitClock`)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        size: int,
        next: int,
        prev: int,
        back_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group, self.rank, self.size, self.next, self.prev = group, rank, size, next, prev
        self.back_group = group if back_group is None else back_group
        self.waited = WaitClock()
        self.exchanges = {False: 0, True: 0}
        self.blocks = {False: 0, True: 0}
        self.exposed = {False: 0, True: 0}

    def note_block(self, backward: bool) -> None:
        self.blocks[backward] += 1

    def exchange(self, tensor: torch.Tensor, backward: bool = False) -> Pending:
        tensor = tensor.contiguous()
        buffer = torch.empty_like(tensor)
        group = self.back_group if backward else self.group
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, group),
            dist.P2POp(dist.irecv, buffer, self.prev, group),
        ]
        self.exchanges[backward] += 1
        return _Received(dist.batch_isend_irecv(ops), buffer, self, backward)


def block_slices(rank: int, src: int, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that local queries of ``rank`` need from the key/value block of
    ``src``, both of ``length`` = 2c tokens (module docstring)."""
    half = length // 2
    if src == rank:
        return slice(0, length), slice(0, length), True
    if src < rank:
        return slice(0, length), slice(0, half), False
    return slice(half, length), slice(0, length), False


#: Keys per tile of a block's attention: the largest score tensor held is [b, heads, n, KEY_TILE] in
#: fp32 (Flash-Attention's tiling; a whole block's fp32 scores would be [b, heads, n, m]).
KEY_TILE = 512


def _tile_scores(q: torch.Tensor, k_t: torch.Tensor, causal: bool, scale: float, c0: int) -> torch.Tensor:
    """One tile's scores q·k_tᵀ·scale: the product in the compute dtype, the result in fp32 (the
    softmax's exponent); causal: key c0 + j masked for query row i < c0 + j."""
    s = torch.matmul(q, k_t.transpose(-1, -2)).float() * scale
    if causal:
        n, m = s.shape[-2:]
        rows = torch.arange(n, device=s.device).unsqueeze(-1)
        cols = torch.arange(c0, c0 + m, device=s.device)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _tiles(m: int, causal: bool, n: int) -> range:
    """Start of each key tile (a causal block's keys past the last query are all masked: skipped)."""
    return range(0, min(m, n) if causal else m, KEY_TILE)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(qkᵀ·scale)v (float32) and the rows' log-sum-exp [b, heads, n], over key tiles of
    :data:`KEY_TILE` with the online softmax (Milakov & Gimelshein 2018; Dao et al.'s FlashAttention):
    per tile, with running row maximum μ, sum ℓ and output o (fp32),

        μ' = max(μ, max_j s_j),  ℓ' = ℓ·e^{μ−μ'} + Σ_j e^{s_j−μ'},  o' = o·e^{μ−μ'} + Σ_j e^{s_j−μ'} v_j,

    the products in the compute dtype; at the end O = o/ℓ and L = μ + log ℓ."""
    n, m = q.shape[-2], k.shape[-2]
    mu = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    ell = torch.zeros(q.shape[:-1], device=q.device)
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for c0 in _tiles(m, causal, n):
        s = _tile_scores(q, k[..., c0 : c0 + KEY_TILE, :], causal, scale, c0)
        new = torch.maximum(mu, s.amax(-1))
        safe = new.masked_fill(new == float("-inf"), 0.0)  # a row with every key so far masked
        p = torch.exp(s - safe.unsqueeze(-1))
        decay = torch.exp(mu - safe)
        ell = ell * decay + p.sum(-1)
        o = o * decay.unsqueeze(-1) + torch.matmul(p.to(v.dtype), v[..., c0 : c0 + KEY_TILE, :]).float()
        mu = new
    return o / ell.unsqueeze(-1), mu + torch.log(ell)


def merge_(out: torch.Tensor, lse: torch.Tensor, rows: slice, o_b: torch.Tensor, l_b: torch.Tensor) -> None:
    """Fold a partial (o_b, l_b) over query ``rows`` into the running (out, lse), in place."""
    l_a = lse[..., rows]
    new = torch.logaddexp(l_a, l_b)
    out[..., rows, :] = out[..., rows, :] * torch.exp(l_a - new).unsqueeze(-1) + o_b * torch.exp(
        l_b - new
    ).unsqueeze(-1)
    lse[..., rows] = new


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block (float32) given the final log-sum-exp and delta = rowsum(dO ⊙ O),
    tile by tile over the keys as :func:`block_forward` (the products in the compute dtype)."""
    n, m = q.shape[-2], k.shape[-2]
    dt = q.dtype
    d_out = d_out.to(dt)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for c0 in _tiles(m, causal, n):
        cols = slice(c0, c0 + KEY_TILE)
        k_t, v_t = k[..., cols, :], v[..., cols, :]
        p = torch.exp(_tile_scores(q, k_t, causal, scale, c0) - lse.unsqueeze(-1))
        dv[..., cols, :] = torch.matmul(p.to(dt).transpose(-1, -2), d_out).float()
        ds = p * (torch.matmul(d_out, v_t.transpose(-1, -2)).float() - delta.unsqueeze(-1))
        ds = ds.to(dt)
        dq += torch.matmul(ds, k_t).float() * scale
        dk[..., cols, :] = torch.matmul(ds.transpose(-1, -2), q).float() * scale
    return dq, dk, dv


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """[2, b, g, n, d] key/value heads repeated for grouped-query attention: [2, b, g·rep, n, d]."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=2)


def _fold(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of :func:`_expand` for one of k, v: [b, g·rep, n, d] summed to [b, g, n, d]."""
    if rep == 1:
        return grad
    b, heads, n, d = grad.shape
    return grad.view(b, heads // rep, rep, n, d).sum(2)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole (load-balanced) sequence; q is
    [b, heads, 2c, d], k and v [b, kv_heads, 2c, d] (grouped-query: each kv head serves
    heads/kv_heads query heads; only the kv heads travel round the ring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        n, rep = q.shape[-2], q.shape[1] // k.shape[1]
        kv = torch.stack([k, v])
        out = lse = None
        for i in range(ring.size):
            pending = ring.exchange(kv) if i < ring.size - 1 else None  # overlapped with this block
            src = (ring.rank - i) % ring.size
            rows, cols, causal = block_slices(ring.rank, src, n)
            k_b, v_b = _expand(kv[..., cols, :], rep)
            o_b, l_b = block_forward(q[..., rows, :], k_b, v_b, causal, scale)
            _note_block(ring, backward=False)
            if out is None:  # step 0 is the diagonal block: every row
                out, lse = o_b, l_b
            else:
                merge_(out, lse, rows, o_b, l_b)
            if pending is not None:
                kv = pending.wait()
        ctx.ring, ctx.scale, ctx.rep = ring, scale, rep
        out = out.to(q.dtype)  # kept in the compute dtype, as FlashAttention keeps its output
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, rep, n = ctx.ring, ctx.scale, ctx.rep, q.shape[-2]
        d_out = d_out.float()
        delta = (d_out * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        home = torch.zeros_like(kv, dtype=torch.float32)  # the diagonal block's dK/dV
        travelling = None  # the exchange of an accumulator: ours out, the next block's in
        for i in range(ring.size):
            pending = ring.exchange(kv, backward=True) if i < ring.size - 1 else None
            src = (ring.rank - i) % ring.size
            rows, cols, causal = block_slices(ring.rank, src, n)
            k_b, v_b = _expand(kv[..., cols, :], rep)
            dq_b, dk_b, dv_b = block_backward(
                q[..., rows, :],
                k_b,
                v_b,
                d_out[..., rows, :],
                delta[..., rows],
                lse[..., rows],
                causal,
                scale,
            )
            _note_block(ring, backward=True)
            dq[..., rows, :] += dq_b
            if i == 0:
                acc = home
            elif travelling is None:  # the block's first visit after home
                acc = torch.zeros_like(home)
            else:
                acc = travelling.wait()
            acc[0][..., cols, :] += _fold(dk_b, rep)
            acc[1][..., cols, :] += _fold(dv_b, rep)
            if i > 0:  # waited after the next block's computation (double buffering)
                travelling = ring.exchange(acc, backward=True)
            if pending is not None:
                kv = pending.wait()
        if travelling is not None:  # this rank's own accumulator, home after the last step
            home += travelling.wait()
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None


class RingAttentionCore(AttentionCore):
    """:class:`~pipewright.models.blocks.AttentionCore` over a context-parallel ring: the same causal
    softmax(QKᵀ/√d)V, for this rank's two chunks against the whole sequence (grouped-query key/value
    heads repeated per block, after the ring)."""

    def __init__(self, ring: Ring) -> None:
        super().__init__()
        self.ring = ring

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return RingAttention.apply(q, k, v, self.ring)
