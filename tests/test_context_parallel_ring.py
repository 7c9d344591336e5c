"""Ring attention's math against full causal attention, the cp ranks simulated by threads of one process
(a queue per rank stands for the ring's isend/irecv), and context parallelism's one-line errors.

For cp ∈ {1, 2, 3, 4} and grouped-query heads: each simulated rank's output equals full causal
attention at its load-balanced positions (chunks r and 2·cp−1−r), and the gradients of q, k, v
assembled from the ranks equal full attention's, within 1e-5 (fp32). Each rank's ring counts what it
sends and which exchanges it waits with no block computed since they were posted: the forward waits
none so; the backward sends 2·(cp − 1) messages and waits one so, its accumulator coming home; those
bytes are what the cost model's ``pipewright`` ring is priced at (``cost/context_parallel.py``).
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.nn.functional as F

from pipewright import ir
from pipewright.cost.context_parallel import ring_bytes_per_layer, ring_waited_bytes_per_layer
from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec
from pipewright.runtime.parallel.cp import RingAttentionCore, check_context_parallel, local_positions
from pipewright.runtime.parallel.cp.ring import block_slices

B, HEADS, D = 2, 4, 8


class _Got:
    """A receive posted on ``ring``: messages are matched to receives in posting order (as P2P is)."""

    def __init__(self, ring: ThreadRing, nbytes: int, backward: bool) -> None:
        self.ring, self.value, self.nbytes, self.backward = ring, None, nbytes, backward
        self.blocks_at_post = ring.blocks[backward]
        ring.posted.append(self)

    def wait(self) -> torch.Tensor:
        if self.ring.blocks[self.backward] == self.blocks_at_post:  # no block computed behind it
            self.ring.exposed[self.backward] += self.nbytes
        while self.value is None:
            self.ring.posted.pop(0).value = self.ring.queues[self.ring.rank].get(timeout=30)
        return self.value


class ThreadRing:
    """Rank ``rank`` of ``size`` threads: exchange puts into the next rank's queue, reads its own;
    bytes sent, and bytes waited with no block computed since their exchange, by direction."""

    def __init__(self, rank: int, size: int, queues: list[queue.Queue]) -> None:
        self.rank, self.size, self.queues, self.posted = rank, size, queues, []
        self.sent, self.exposed = {False: 0, True: 0}, {False: 0, True: 0}
        self.messages, self.blocks = {False: 0, True: 0}, {False: 0, True: 0}

    def note_block(self, backward: bool) -> None:
        self.blocks[backward] += 1

    def exchange(self, tensor: torch.Tensor, backward: bool = False) -> _Got:
        self.queues[(self.rank + 1) % self.size].put(tensor.clone())
        nbytes = tensor.numel() * tensor.element_size()
        self.sent[backward] += nbytes
        self.messages[backward] += 1
        return _Got(self, nbytes, backward)


def _full(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("cp,kv_heads,seq", [(1, 4, 8), (2, 4, 8), (2, 2, 16), (3, 1, 12), (4, 4, 16)])
def test_ring_attention_equals_full_causal_attention(cp: int, kv_heads: int, seq: int):
    gen = torch.Generator().manual_seed(cp * 100 + seq)
    q = torch.randn(B, HEADS, seq, D, generator=gen)
    k = torch.randn(B, kv_heads, seq, D, generator=gen)
    v = torch.randn(B, kv_heads, seq, D, generator=gen)
    g = torch.randn(B, HEADS, seq, D, generator=gen)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    want = _full(qf, kf, vf)
    want.backward(g)

    queues = [queue.Queue() for _ in range(cp)]
    rings = [ThreadRing(r, cp, queues) for r in range(cp)]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pos = local_positions(seq, cp, r)
            ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
            out = RingAttentionCore(rings[r])(ql, kl, vl)
            out.backward(g[:, :, pos])
            results[r] = (pos, out.detach(), ql.grad, kl.grad, vl.grad)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    for pos, o, gq, gk, gv in results.values():
        out[:, :, pos], dq[:, :, pos], dk[:, :, pos], dv[:, :, pos] = o, gq, gk, gv
    for name, got, ref in (("out", out, want), ("dq", dq, qf.grad), ("dk", dk, kf.grad), ("dv", dv, vf.grad)):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5, msg=name)
    spec = ModelSpec("ring", 1, HEADS * D, HEADS, 64, seq, family="llama", kv_heads=kv_heads)
    sent = ring_bytes_per_layer(spec, B, cp, 1, 4, ring="pipewright")
    waited = ring_waited_bytes_per_layer(spec, B, cp, 1, 4, ring="pipewright")
    for ring in rings:  # the backward's exchanges overlap the block computations but the last
        assert ring.messages == {False: cp - 1, True: 2 * (cp - 1)}
        assert (ring.sent[False], ring.sent[True]) == (sent[ir.F], sent[ir.I])
        assert (ring.exposed[False], ring.exposed[True]) == (waited[ir.F], waited[ir.I]) == (0, waited[ir.B])
        assert (waited[ir.I] > 0) == (cp > 1)


def test_positions_cover_the_sequence_in_balanced_pairs():
    for cp in (1, 2, 3, 4):
        seq = 4 * cp
        held = [local_positions(seq, cp, r).tolist() for r in range(cp)]
        assert sorted(p for h in held for p in h) == list(range(seq))
        c = seq // (2 * cp)
        assert held[0][:c] == list(range(c)) and held[0][c:] == list(range(seq - c, seq))
        # causal work per rank: Σ over its positions of (position + 1), equal on every rank
        assert len({sum(p + 1 for p in h) for h in held}) == 1
        for r in range(cp):  # block choices: the diagonal, a half block, or half the queries
            assert block_slices(r, r, 2 * c) == (slice(0, 2 * c), slice(0, 2 * c), True)


@pytest.mark.parametrize("seq,cp", [(8, 3), (6, 2), (10, 4)])
def test_sequence_not_split_into_two_cp_chunks_is_one_line_error(seq: int, cp: int):
    with pytest.raises(ConfigError) as err:
        check_context_parallel(seq, cp)
    assert "\n" not in str(err.value) and f"2·cp = {2 * cp}" in str(err.value)


@pytest.mark.parametrize(
    "flags,names",
    [
        (["--vocab-parallel", "alg1"], "--vocab-parallel"),
        (["--optimizer", "kfac"], "--optimizer kfac"),
        (["--schedule", "async-1f1b"], "asynchronous schedules"),
        # experts route each cp rank's own tokens; only a capacity (per rank, not per sequence) is refused
        (
            ["--moe-experts", "4", "--moe-top-k", "2", "--model", "gpt-moe-tiny", "--moe-capacity", "1.25"],
            "--moe-capacity",
        ),
    ],
)
def test_features_that_hold_whole_sequences_refuse_cp_in_one_line(flags, names, tmp_path, capsys):
    """Features whose groups or statistics assume whole sequences on a rank refuse --cp before any
    worker starts (train --dry-run runs every check)."""
    from pipewright.cli import main

    argv = ["train", "--dry-run", "--pp", "2", "--cp", "2", "--seq-len", "64", "--out", str(tmp_path / "r")]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0] and "--cp" in err[0]


def test_simulated_pair_overlap_prices_two_streams():
    """sim/pair_overlap.py: with F, B = 1, 2 of compute plus x of exposed ring waits each, DualPipeV's
    pairs cost max(c_F + c_B, x_F + x_B) instead of the sum; a schedule without pairs is unchanged."""
    from pipewright.cost.unit import UnitCost
    from pipewright.schedules.registry import build_schedule
    from pipewright.sim.engine import simulate
    from pipewright.sim.pair_overlap import PairOverlapCost, overlapped_pairs, pair_time

    assert pair_time(1.0, 0.5, 2.0, 0.5, overlap=False) == 4.0
    assert pair_time(1.0, 0.5, 2.0, 0.5, overlap=True) == 3.0
    assert pair_time(0.1, 1.0, 0.1, 1.0, overlap=True) == 2.0  # communication-bound pair
    x = 0.25
    base = UnitCost(times={"F": 1 + x, "B": 2 + x, "I": 1 + x, "W": 1.0})

    def exposed(a, _):
        return x if a.kind in ("F", "B", "I") else 0.0

    dual = build_schedule("dualpipev", 2, 8, 2)
    pairs = overlapped_pairs(dual)
    assert pairs and all(f.kind == "F" and b.kind == "B" for f, b in pairs.items())
    over = simulate(dual, PairOverlapCost(base, exposed, overlap=True)).makespan
    block = simulate(dual, PairOverlapCost(base, exposed, overlap=False)).makespan
    assert block == simulate(dual, base).makespan
    assert over < block
    one = build_schedule("1f1b", 2, 8)
    assert simulate(one, PairOverlapCost(base, exposed)).makespan == simulate(one, base).makespan
