"""Vocabulary-parallel layers over gloo against the unpartitioned layers (float32, 1e-5 relative).

Workers are spawned once per world size (4, then 8); every (p, t, algorithm) case runs inside them on
its own vocabulary group, with a rank order that is not the identity (shard q need not live on global
rank q). Each case runs three microbatches the way a pipeline does (S of microbatch k+1 issued before
T of k), does all collectives first and compares afterwards, so a mismatch cannot deadlock the others.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from _queue_spawn import spawn_cases
from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.layers import VocabEmbedding, VocabGroup, VocabOutput

RTOL = 1e-5
TOKENS, H, V, M = 10, 16, 45, 3
#: (p, t, global ranks in shard order) per world size
LAYOUTS = {
    4: [(2, 1, [1, 0]), (4, 1, [3, 1, 0, 2]), (2, 2, [2, 0, 3, 1])],
    8: [(4, 2, [7, 6, 5, 4, 3, 2, 1, 0])],
}
VARIANTS = [("naive", None), ("alg1", None), ("alg2", None), ("alg1", 4), ("alg2", 3)]


def _err(label: str, actual: Tensor, expected: Tensor) -> str:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1e-12)
    return "" if err <= RTOL * scale else f"{label}: max error {err:.3g} over scale {scale:.3g}"


def _data():
    g = torch.Generator().manual_seed(5)
    w_out = torch.randn(V, H, generator=g)
    w_emb = torch.randn(V, H, generator=g)
    xs = [torch.randn(TOKENS, H, generator=g) * 2 for _ in range(M)]
    labels = [torch.randint(0, V, (TOKENS,), generator=g) for _ in range(M)]
    dloss = [torch.rand(TOKENS, generator=g) + 0.5 for _ in range(M)]
    ids = [torch.randint(0, V, (2, TOKENS // 2), generator=g) for _ in range(M)]
    gemb = [torch.randn(2, TOKENS // 2, H, generator=g) for _ in range(M)]
    return w_out, w_emb, xs, labels, dloss, ids, gemb


def _reference():
    w_out, w_emb, xs, labels, dloss, ids, gemb = _data()
    wo = w_out.clone().requires_grad_()
    we = w_emb.clone().requires_grad_()
    losses, gxs, embs = [], [], []
    for k in range(M):
        x = xs[k].clone().requires_grad_()
        loss = F.cross_entropy(x @ wo.t(), labels[k], reduction="none")
        (loss * dloss[k]).sum().backward()
        losses.append(loss.detach())
        gxs.append(x.grad)
        out = F.embedding(ids[k], we)
        out.backward(gemb[k])
        embs.append(out.detach())
    return losses, gxs, wo.grad, embs, we.grad


def _case(vg: VocabGroup, algorithm: str, chunk: int | None) -> list[tuple[str, Tensor, Tensor]]:
    w_out, w_emb, xs, labels, dloss, ids, gemb = _data()
    q, shards = vg.index, vg.shards
    last = dist.get_rank() == vg.last_stage_src
    first = dist.get_rank() == vg.first_stage_src
    out = VocabOutput(vs.split_weight(w_out, shards)[q], V, vg, algorithm, chunk)
    emb = VocabEmbedding(vs.split_weight(w_emb, shards)[q], V, vg)
    losses, gxs, embs = [], [], []
    pend = out.receive_input(0, xs[0] if last else None, labels[0], (TOKENS, H))
    pend.wait()
    out.s_pass(0)
    for k in range(M):
        if k + 1 < M:  # the next microbatch's S before this one's T, as the schedule places them
            out.receive_input(k + 1, xs[k + 1] if last else None, labels[k + 1], (TOKENS, H)).wait()
            out.s_pass(k + 1)
        losses.append(out.loss(k))
        out.t_pass(k, dloss[k])
        gxs.append(out.input_grad(k))
        embs.append(emb.forward(ids[k]).wait())
        emb.backward(ids[k], gemb[k] if first else None).wait()
    ref_losses, ref_gx, ref_gw, ref_emb, ref_gemb = _reference()
    start, end, _ = vs.shard_range(V, shards, q)
    pad = vs.padded_vocab(V, shards) - V
    ref_gw = torch.cat([ref_gw, ref_gw.new_zeros(pad, H)])[start:end]
    ref_gemb = torch.cat([ref_gemb, ref_gemb.new_zeros(pad, H)])[start:end]
    pairs = [("grad W out", out.weight.grad, ref_gw), ("grad W emb", emb.weight.grad, ref_gemb)]
    for k in range(M):
        pairs.append((f"loss {k}", losses[k], ref_losses[k]))
        if last:
            pairs.append((f"grad x {k}", gxs[k], ref_gx[k]))
        if first:
            pairs.append((f"embedding {k}", embs[k], ref_emb[k]))
    return pairs


def _cases(rank: int, world: int) -> dict[str, str]:
    results: dict[str, str] = {}
    for p, t, ranks in LAYOUTS[world]:
        vg = VocabGroup.create(ranks, tp=t)  # collective: every rank creates every group
        if rank not in ranks:
            continue
        for algorithm, chunk in VARIANTS:
            name = f"p={p} t={t} {algorithm}" + (f" chunk={chunk}" if chunk else "")
            try:
                errors = [_err(*pair) for pair in _case(vg, algorithm, chunk)]
                results[name] = "; ".join(e for e in errors if e)
            except Exception:
                results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, list[str]]]:
    return {world: spawn_cases(_cases, world) for world in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "p", "t"), [(w, p, t) for w, layouts in LAYOUTS.items() for p, t, _ in layouts]
)
@pytest.mark.parametrize(("algorithm", "chunk"), VARIANTS)
def test_vocab_layers_match_unpartitioned(results, world, p, t, algorithm, chunk) -> None:
    name = f"p={p} t={t} {algorithm}" + (f" chunk={chunk}" if chunk else "")
    got = results[world][name]
    assert len(got) == p * t, f"{name}: {len(got)} ranks reported"
    bad = [e for e in got if e]
    assert not bad, "\n".join(bad)
