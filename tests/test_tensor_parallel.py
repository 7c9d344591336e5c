"""Tensor parallelism against single-process references with the same seed.

Gloo workers are spawned once per world size (2, then 4); every case runs inside them, on the whole
world as the tensor-parallel group and, with 4 processes, also on two t = 2 subgroups. Each case does
all its collectives first and compares afterwards, so a mismatch on one rank cannot deadlock the
others. Outputs and gradients (weight gradients gathered to full size) must agree within 1e-5
relative (fp32, max-norm).
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from _queue_spawn import spawn_cases
from pipewright.errors import ConfigError
from pipewright.models.gpt import TokenEmbedding, build_full, build_stage, loss_fn
from pipewright.models.llama_decoder import build_stage as build_llama
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import WeightGradStore, defer_weight_grads, plain_linear_factory
from pipewright.optim.stage_optimizer import global_grad_norm
from pipewright.runtime.core.executor import PipelineExecutor
from pipewright.runtime.parallel import tp
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.schedules.registry import build_schedule

WORLD_SIZES = (2, 4)
RTOL = 1e-5
B, S, H, HEADS, FFN, V = 2, 8, 16, 4, 32, 32

Pairs = list[tuple[str, Tensor, Tensor]]


def _close(label: str, actual: Tensor | None, expected: Tensor | None) -> str:
    if actual is None or expected is None:
        return f"{label}: missing tensor (actual {actual is None}, expected {expected is None})"
    if actual.shape != expected.shape:
        return f"{label}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1e-12)
    return "" if err <= RTOL * scale else f"{label}: max error {err:.3g} over scale {scale:.3g}"


def _randn(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunk(x: Tensor, dim: int, r: int, t: int) -> Tensor:
    return x.chunk(t, dim)[r]


# --------------------------------------------------------------------------- cases


def case_mappings(group, r: int, t: int) -> Pairs:
    """Each mapping's forward and backward against its formula (inputs differ per rank)."""
    xs = [_randn(10 + q, B, S, H) for q in range(t)]
    gs = [_randn(20 + q, B, S, H) for q in range(t)]
    pairs: Pairs = []

    def run(fn: Callable[[Tensor], Tensor], x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(g)
        return y.detach(), x.grad

    sum_x, sum_g = sum(xs), sum(gs)
    y, gx = run(lambda x: tp.copy_to(x, group), xs[r], gs[r])
    pairs += [("copy_to fwd", y, xs[r]), ("copy_to bwd", gx, sum_g)]
    y, gx = run(lambda x: tp.reduce_from(x, group), xs[r], gs[r])
    pairs += [("reduce_from fwd", y, sum_x), ("reduce_from bwd", gx, gs[r])]
    g_small = [_chunk(g, -1, 0, t) for g in gs]
    y, gx = run(lambda x: tp.scatter_to(x, group), xs[0], g_small[r])
    pairs += [("scatter_to fwd", y, _chunk(xs[0], -1, r, t)), ("scatter_to bwd", gx, torch.cat(g_small, -1))]
    x_small = [_chunk(x, -1, 0, t) for x in xs]
    y, gx = run(lambda x: tp.gather_from(x, group), x_small[r], gs[r])
    pairs += [
        ("gather_from fwd", y, torch.cat(x_small, -1)),
        ("gather_from bwd", gx, _chunk(gs[r], -1, r, t)),
    ]
    g_seq = [_chunk(g, 1, 0, t) for g in gs]
    y, gx = run(lambda x: tp.reduce_scatter_to_seq(x, group), xs[r], g_seq[r])
    pairs += [
        ("reduce_scatter fwd", y, _chunk(sum_x, 1, r, t)),
        ("reduce_scatter bwd", gx, torch.cat(g_seq, 1)),
    ]
    x_seq = [_chunk(x, 1, 0, t) for x in xs]
    y, gx = run(lambda x: tp.gather_from_seq(x, group), x_seq[r], gs[r])
    pairs += [("gather_seq fwd", y, torch.cat(x_seq, 1)), ("gather_seq bwd", gx, _chunk(sum_g, 1, r, t))]
    y, gx = run(lambda x: tp.count_once(x, group), xs[r], gs[r])
    pairs += [
        ("count_once fwd", y, xs[r] if r == 0 else torch.zeros_like(xs[r])),
        ("count_once bwd", gx, gs[r]),
    ]
    return pairs


def case_scatter_gather_between_stages(group, r: int, t: int) -> Pairs:
    """split_for_send → (send) → gather_after_recv is the identity, forward and backward."""
    x = _randn(1, B, S, H).requires_grad_()
    chunk = tp.split_for_send(x * 2, group)
    received = chunk.detach().requires_grad_()  # what the next stage receives
    full = tp.gather_after_recv(received, group, x.shape)
    g = _randn(2, B, S, H)
    full.backward(g)
    chunk.backward(received.grad)  # the gradient chunk sent back
    return [
        ("chunk is 1/t of the flat tensor", chunk.detach(), _chunk((x * 2).detach().reshape(-1), 0, r, t)),
        ("round trip", full.detach(), (x * 2).detach()),
        ("grad chunk", received.grad, _chunk(g.reshape(-1), 0, r, t)),
        ("grad round trip", x.grad, 2 * g),
    ]


def _column_vs_linear(group, r, t, *, bias, gather, blocks) -> Pairs:
    torch.manual_seed(5)
    ref = nn.Linear(H, 3 * FFN if blocks == 3 else FFN, bias=bias)
    torch.manual_seed(5)
    layer = tp.ColumnParallelLinear(
        ref.in_features, ref.out_features, group, bias=bias, gather_output=gather, blocks=blocks
    )
    x = _randn(3, B, S, H).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    g = _randn(4, B, S, ref.out_features)
    y_ref = ref(xr)
    (y_ref * g).sum().backward()
    y = layer(x)
    if gather:
        (y * g).sum().backward()
        expected_y = y_ref
    else:  # local shard of each fused block
        g_local = tp.parallel_linears.shard(g, -1, r, t, blocks)
        (y * g_local).sum().backward()
        expected_y = tp.parallel_linears.shard(y_ref, -1, r, t, blocks)
    name = f"column(bias={bias}, gather={gather}, blocks={blocks})"
    pairs = [
        (f"{name} weight init", layer.full_weight(), ref.weight.detach()),
        (f"{name} fwd", y.detach(), expected_y.detach()),
        (f"{name} grad x", x.grad, xr.grad),
        (f"{name} grad W", layer.full_weight(grad=True), ref.weight.grad),
    ]
    if bias:
        pairs.append((f"{name} grad b", layer.full_bias(grad=True), ref.bias.grad))
    return pairs


def case_column_parallel_linear(group, r: int, t: int) -> Pairs:
    pairs: Pairs = []
    for bias, gather, blocks in [(True, False, 1), (False, True, 1), (True, False, 3), (True, True, 3)]:
        pairs += _column_vs_linear(group, r, t, bias=bias, gather=gather, blocks=blocks)
    return pairs


def case_row_parallel_linear(group, r: int, t: int) -> Pairs:
    pairs: Pairs = []
    for input_is_parallel in (True, False):
        torch.manual_seed(6)
        ref = nn.Linear(FFN, H)
        torch.manual_seed(6)
        layer = tp.RowParallelLinear(FFN, H, group, input_is_parallel=input_is_parallel)
        x_full = _randn(7, B, S, FFN)
        x = (_chunk(x_full, -1, r, t) if input_is_parallel else x_full).clone().requires_grad_()
        xr = x_full.clone().requires_grad_()
        g = _randn(8, B, S, H)
        (ref(xr) * g).sum().backward()
        y = layer(x)
        (y * g).sum().backward()
        expected_gx = _chunk(xr.grad, -1, r, t) if input_is_parallel else xr.grad
        name = f"row(input_is_parallel={input_is_parallel})"
        pairs += [
            (f"{name} fwd", y.detach(), ref(xr).detach()),
            (f"{name} grad x", x.grad, expected_gx),
            (f"{name} grad W", layer.full_weight(grad=True), ref.weight.grad),
            (f"{name} grad b", layer.full_bias(grad=True), ref.bias.grad),
        ]
    return pairs


def case_sequence_parallel_linear_keeps_its_chunk(group, r: int, t: int) -> Pairs:
    """A sequence-parallel column-parallel linear keeps for backward its input's 1/t sequence chunk
    and its weight shard, not the gathered sequence (Korthikanti et al., 2022, §4.2.2)."""
    layer = tp.ColumnParallelLinear(H, FFN, group, sequence_parallel=True)
    x = _randn(12, B, S // t, H).requires_grad_()
    kept: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: kept.append(v.numel()) or v, lambda v: v):
        layer(x)
    return [("SP saved numels", torch.tensor(sorted(kept)), torch.tensor(sorted([x.numel(), FFN // t * H])))]


def case_sequence_parallel_mlp(group, r: int, t: int) -> Pairs:
    """column(SP) → gelu → row(SP) on this rank's sequence chunk equals the dense MLP's chunk."""
    torch.manual_seed(9)
    ref = nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H))
    torch.manual_seed(9)
    mlp = nn.Sequential(
        tp.ColumnParallelLinear(H, FFN, group, sequence_parallel=True),
        nn.GELU(),
        tp.RowParallelLinear(FFN, H, group, sequence_parallel=True),
    )
    x_full, g = _randn(10, B, S, H), _randn(11, B, S, H)
    xr = x_full.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * g).sum().backward()
    x = _chunk(x_full, 1, r, t).clone().requires_grad_()
    y = mlp(x)
    (y * _chunk(g, 1, r, t)).sum().backward()
    tp.sync_sequence_parallel_grads(mlp, group)
    return [
        ("SP fwd", y.detach(), _chunk(y_ref, 1, r, t).detach()),
        ("SP grad x", x.grad, _chunk(xr.grad, 1, r, t)),
        ("SP grad W1", mlp[0].full_weight(grad=True), ref[0].weight.grad),
        ("SP grad b1", mlp[0].full_bias(grad=True), ref[0].bias.grad),
        ("SP grad W2", mlp[2].full_weight(grad=True), ref[2].weight.grad),
        ("SP grad b2 (synced)", mlp[2].bias.grad, ref[2].bias.grad),
    ]


def case_vocab_parallel_embedding(group, r: int, t: int) -> Pairs:
    """The table's forward and gradient equal nn.Embedding's, SP off/on; a replicated tensor added
    through ``add`` (the position embeddings, [1, s, h]) is counted once in the output and gets the
    whole gradient (summed over the batch) on every rank, with no collective of its own."""
    pairs: Pairs = []
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(12))
    g = _randn(13, B, S, H)
    add_ref = _randn(24, 1, S, H).requires_grad_()
    for sp in (False, True):
        torch.manual_seed(14)
        ref = nn.Embedding(V, H)
        torch.manual_seed(14)
        emb = tp.VocabParallelEmbedding(V, H, group, sequence_parallel=sp)
        add = add_ref.detach().clone().requires_grad_()
        add_ref.grad = None
        y_ref = ref(ids) + add_ref
        (y_ref * g).sum().backward()
        y = emb(ids, add)
        (y * (_chunk(g, 1, r, t) if sp else g)).sum().backward()
        expected = _chunk(y_ref, 1, r, t) if sp else y_ref
        pairs += [
            (f"embedding(sp={sp}) init", emb.full_weight(), ref.weight.detach()),
            (f"embedding(sp={sp}) fwd", y.detach(), expected.detach()),
            (f"embedding(sp={sp}) grad", emb.full_weight(grad=True), ref.weight.grad),
            (f"embedding(sp={sp}) added tensor's grad", add.grad, add_ref.grad),
        ]
    return pairs


def case_sharded_vocab_cross_entropy(group, r: int, t: int) -> Pairs:
    """Loss and grad equal F.cross_entropy, also for logits around 1e4 (stability) and ignored targets."""
    pairs: Pairs = []
    targets = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(15))
    targets[0, :3] = -100
    for scale, offset in [(1.0, 0.0), (30.0, 1e4)]:
        logits = _randn(16, B, S, V) * scale + offset
        ref = logits.clone().requires_grad_()
        loss_ref = F.cross_entropy(ref.view(-1, V), targets.view(-1))
        loss_ref.backward()
        shard = _chunk(logits, -1, r, t).clone().requires_grad_()
        loss = tp.sharded_vocab_cross_entropy(shard, targets, group)
        (2 * loss).backward()
        none = tp.sharded_vocab_cross_entropy(shard.detach(), targets, group, reduction="none")
        none_ref = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(B, S)
        pairs += [
            (f"CE(scale={scale}) loss", loss.detach(), loss_ref.detach()),
            (f"CE(scale={scale}) per token", none, none_ref),
            (f"CE(scale={scale}) grad", shard.grad, 2 * _chunk(ref.grad, -1, r, t)),
        ]
    return pairs


class _Block(nn.Module):
    """A pre-LayerNorm GPT block whose linears come from ``linear_factory``."""

    def __init__(self, linear_factory) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv = linear_factory(H, 3 * H, bias=True, kind="qkv")
        self.proj = linear_factory(H, H, bias=True, kind="attn_out")
        self.fc = linear_factory(H, FFN, bias=True, kind="mlp_in")
        self.fc2 = linear_factory(FFN, H, bias=True, kind="mlp_out")

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        b, s = q.shape[:2]
        q, k, v = (z.view(b, s, -1, H // HEADS).transpose(1, 2) for z in (q, k, v))  # local heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class _TinyGPT(nn.Module):
    """Two blocks, token + position embeddings, final LayerNorm, untied output layer."""

    def __init__(self, linear_factory, embedding) -> None:
        super().__init__()
        self.wte, self.wpe = embedding(V, H), nn.Embedding(S, H)
        self.wpe.weight.tp_grad_whole = True  # added inside the token embedding, before its reduction
        self.blocks = nn.ModuleList([_Block(linear_factory) for _ in range(2)])
        self.ln_f = nn.LayerNorm(H)
        self.head = linear_factory(H, V, bias=False, kind="output")

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids, self.wpe(torch.arange(ids.size(1))).unsqueeze(0))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _dense_model() -> _TinyGPT:
    torch.manual_seed(17)
    return _TinyGPT(plain_linear_factory, TokenEmbedding)


def _tp_model(group, sp: bool) -> tuple[_TinyGPT, tp.TensorParallelFactory]:
    factory = tp.tp_linear_factory(group, sequence_parallel=sp, num_heads=HEADS)
    torch.manual_seed(17)
    return _TinyGPT(factory, factory.embedding), factory


def _full_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter gradient at full size (sharded ones gathered; collective)."""
    out: dict[str, Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, tp.ColumnParallelLinear | tp.RowParallelLinear):
            out[f"{name}.weight"] = m.full_weight(grad=True)
            if m.bias is not None:
                out[f"{name}.bias"] = m.full_bias(grad=True)
        elif isinstance(m, tp.VocabParallelEmbedding):
            out[f"{name}.weight"] = m.full_weight(grad=True)
        elif isinstance(m, nn.LayerNorm | nn.Embedding):
            out.update({f"{name}.{k}": p.grad for k, p in m.named_parameters()})
    return out


def _block_pairs(label: str, loss, loss_ref, model, ref) -> Pairs:
    grads, ref_grads = _full_grads(model), dict((n, p.grad) for n, p in ref.named_parameters())
    pairs = [(f"{label} loss", loss.detach(), loss_ref.detach())]
    missing = set(ref_grads) ^ set(grads)
    if missing:
        pairs.append((f"{label} parameter names differ: {sorted(missing)}", torch.ones(1), torch.zeros(1)))
    return pairs + [(f"{label} grad {n}", grads.get(n), g) for n, g in ref_grads.items()]


def case_transformer_with_factory(group, r: int, t: int) -> Pairs:
    """A 2-layer GPT built with the factory equals the dense one: loss and every gradient, SP off/on."""
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(18))
    inp, targets = ids[:, :-1], ids[:, 1:]
    ref = _dense_model()
    loss_ref = F.cross_entropy(ref(inp).reshape(-1, V), targets.reshape(-1))
    loss_ref.backward()
    pairs: Pairs = []
    for sp in (False, True):
        model, factory = _tp_model(group, sp)
        loss = factory.cross_entropy(model(inp), targets)
        loss.backward()
        if sp:
            tp.sync_sequence_parallel_grads(model, group)
        pairs += _block_pairs(f"GPT(sp={sp})", loss, loss_ref, model, ref)
    return pairs


def case_gpt_model_with_factory(group, r: int, t: int) -> Pairs:
    """models/gpt.py built with tp_linear_factory (its layers take full-size init through load_full_)
    equals the dense model, SP off/on: loss (vocab-parallel CE vs loss_fn), every gradient and the
    gradient norm. The position table's gradient is whole on every tp rank straight from the backward
    (identical bits on every rank, the reference's), and the SP gradient all-reduce leaves it alone."""
    spec = ModelSpec("tp-test", layers=2, hidden=H, heads=HEADS, vocab=V, seq_len=S)
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(21))
    inp, targets = ids[:, :-1], ids[:, 1:]
    ref = build_full(spec, seed=3, linear_factory=plain_linear_factory)
    loss_ref = loss_fn(ref(inp), targets)
    loss_ref.backward()
    norm_ref = global_grad_norm(list(ref.parameters()))
    pos_ref = ref.embed.pos.weight.grad
    pairs: Pairs = []
    for sp in (False, True):
        factory = tp.tp_linear_factory(group, sequence_parallel=sp, num_heads=spec.heads)
        model = build_full(spec, seed=3, linear_factory=factory)
        loss = factory.cross_entropy(model(inp), targets)
        loss.backward()
        pos = model.embed.pos.weight.grad.clone()
        if sp:
            tp.sync_sequence_parallel_grads(model, group)
        every_rank = tp.ops.all_gather(pos.unsqueeze(0), 0, group)  # [t, s, h]
        norm = global_grad_norm(tp.grad_norm_params(model, group), (group,))
        label = f"models/gpt.py(sp={sp})"
        pairs += [*_block_pairs(label, loss, loss_ref, model, ref), (f"{label} grad norm", norm, norm_ref)]
        pairs += [(f"{label} position grad of tp rank {q}", every_rank[q], pos_ref) for q in range(t)] + [
            (
                f"{label} position grad bits equal on every tp rank",
                (every_rank == pos).all(),
                torch.tensor(True),
            ),
            (f"{label} position grad untouched by the SP sync", model.embed.pos.weight.grad, pos),
        ]
    return pairs


def case_llama_model_with_factory(group, r: int, t: int) -> Pairs:
    """models/llama_decoder.py built with tp_linear_factory equals the dense model, SP off/on, with a
    full backward, with I then W and recomputed in the backward: q, k, v (and gate, up) share one
    gathered input and one reduce-scatter / all-reduce of their summed input gradients."""
    kv = min(t, HEADS)  # grouped-query attention where t allows (t divides the kv heads)
    spec = ModelSpec(
        "tp-llama", layers=2, hidden=H, heads=HEADS, kv_heads=kv, ffn_hidden=FFN, vocab=V, seq_len=S
    )
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(23))
    inp, targets = ids[:, :-1], ids[:, 1:]
    ref = build_llama(spec, None, 0, seed=5, num_stages=1, linear_factory=plain_linear_factory)
    loss_ref = loss_fn(ref(inp), targets)
    loss_ref.backward()
    pairs: Pairs = []
    for sp, split, recompute in (
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ):
        factory = tp.tp_linear_factory(group, sequence_parallel=sp, num_heads=HEADS)
        model = build_llama(spec, None, 0, seed=5, num_stages=1, linear_factory=factory)
        logits = checkpoint(model, inp, use_reentrant=False) if recompute else model(inp)
        loss = factory.cross_entropy(logits, targets)
        store = WeightGradStore()
        with defer_weight_grads(store, model, key=0) if split else contextlib.nullcontext():
            loss.backward()
        store.flush(0)
        if sp:
            tp.sync_sequence_parallel_grads(model, group)
        grads, ref_grads = tp.full_parameters(model, grad=True), dict(ref.named_parameters())
        label = f"llama(sp={sp}, split={split}, recompute={recompute})"
        pairs.append((f"{label} loss", loss.detach(), loss_ref.detach()))
        pairs += [(f"{label} grad {n}", grads.get(n), p.grad) for n, p in ref_grads.items()]
    return pairs


_LINEARS = (tp.ColumnParallelLinear, tp.RowParallelLinear)


def case_deferred_weight_grads(group, r: int, t: int) -> Pairs:
    """I (grad input + communication, weight grads deferred) then W equals the full backward, SP off/on."""
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(19))
    inp, targets = ids[:, :-1], ids[:, 1:]
    pairs: Pairs = []
    for sp in (False, True):
        full, factory = _tp_model(group, sp)
        factory.cross_entropy(full(inp), targets).backward()
        split, factory = _tp_model(group, sp)
        loss = factory.cross_entropy(split(inp), targets)
        store = WeightGradStore()
        with defer_weight_grads(store, split, key=7):
            loss.backward()  # the I pass
        linears = [m for m in split.modules() if isinstance(m, _LINEARS)]
        waiting = all(m.weight.grad is None for m in linears)
        one_each = len(store) == len(linears)
        label = f"split(sp={sp}) W waits, one per linear"
        pairs.append((label, torch.tensor([waiting, one_each]), torch.ones(2)))
        store.flush(7)  # the W pass
        if sp:
            tp.sync_sequence_parallel_grads(full, group)
            tp.sync_sequence_parallel_grads(split, group)
        a, b = _full_grads(split), _full_grads(full)
        pairs += [(f"split(sp={sp}) grad {n}", a[n], b[n]) for n in b]
    return pairs


def case_heads_not_divisible(group, r: int, t: int) -> Pairs:
    """Heads not divisible by t: one clear line naming both numbers."""
    messages = []
    for call in (
        lambda: tp.tp_linear_factory(group, num_heads=t + 1),
        lambda: tp.tp_linear_factory(group).local_heads(2 * t - 1),
    ):
        try:
            call()
            messages.append("no error")
        except ConfigError as e:
            messages.append(str(e))
    ok = all("not divisible by the tensor-parallel size" in m and "\n" not in m for m in messages)
    return [(f"clear error: {messages}", torch.tensor(float(ok)), torch.ones(()))]


def ptd_pipeline_case(mesh: ParallelMesh) -> Pairs:
    """PTD-P end to end: models/gpt.py in 2 pipeline stages × t = 2 run by the PipelineExecutor with
    ZB-H1 (I and W actions, so deferred tensor-parallel weight gradients) equals the dense model."""
    spec = ModelSpec("tp-test", layers=2, hidden=H, heads=HEADS, vocab=V, seq_len=S)
    m = 4
    ids = torch.randint(0, V, (m * B, S + 1), generator=torch.Generator().manual_seed(22))
    inp, targets = ids[:, :-1], ids[:, 1:]
    ref = build_full(spec, seed=3, linear_factory=plain_linear_factory)
    loss_ref = loss_fn(ref(inp), targets)
    loss_ref.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    factory = tp.tp_linear_factory(mesh.tp_group, num_heads=spec.heads)
    schedule = build_schedule("zb-h1", mesh.pp, m)
    stages = {
        s: build_stage(spec, None, s, seed=3, num_stages=mesh.pp, linear_factory=factory)
        for s in schedule.stages_of(mesh.pp_rank)
    }
    ex = PipelineExecutor(
        schedule, mesh, stages, loss_fn=factory.cross_entropy, boundary_shape=(B, S, H), recv_timeout_s=60
    )
    losses = ex.run(list(inp.chunk(m)), list(targets.chunk(m)))
    grads = {n: g for st in stages.values() for n, g in _full_grads(st).items()}
    names = {n for st in stages.values() for n, _ in st.named_parameters()}
    pairs = [(f"PTD grad {n}", grads.get(n), ref_grads[n]) for n in sorted(names)]
    pairs.append(("PTD compares every parameter", torch.tensor(len(grads)), torch.tensor(len(names))))
    if losses:
        pairs.append(("PTD loss", torch.tensor(sum(losses) / m), loss_ref.detach()))
    return pairs


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


# --------------------------------------------------------------------------- the workers


def _run_cases(group, label: str) -> dict[str, str]:
    r, t = tp.tp_rank(group), tp.tp_size(group)
    out = {}
    for name, case in CASES.items():
        try:
            errors = [_close(*pair) for pair in case(group, r, t)]
            out[f"{label}:{name}"] = "\n".join(e for e in errors if e)
        except Exception:
            out[f"{label}:{name}"] = traceback.format_exc()
    return out


def _cases(rank: int, world: int) -> dict[str, str]:
    results = _run_cases(dist.group.WORLD, f"t={world}")
    if world == 4:  # two tensor-parallel groups of 2 inside the world, as a mesh builds them
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results.update(_run_cases(pairs[rank // 2], "t=2 of 4"))
        try:
            errors = [_close(*pair) for pair in ptd_pipeline_case(ParallelMesh.build(1, 2, 2, "cpu"))]
            results["ptd"] = "\n".join(e for e in errors if e)
        except Exception:
            results["ptd"] = traceback.format_exc()
    return results


def _warning_cases(rank: int, world: int) -> dict[str, str]:
    """Every warning the TP ops raise in forward and backward (sequence-parallel MLP: reduce-scatter
    and all-gather; vocabulary-parallel embedding and cross-entropy), one line each."""
    group = dist.group.WORLD
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in (
            case_sequence_parallel_mlp,
            case_vocab_parallel_embedding,
            case_sharded_vocab_cross_entropy,
        ):
            case(group, rank, world)
    return {
        "warnings": "; ".join(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught)
    }


def test_tensor_parallel_ops_raise_no_warnings() -> None:
    """torch 2.13 deprecates ``reduce_scatter_tensor`` with a FutureWarning per call (one per worker per
    step in a tp run); the ops use ``reduce_scatter_single`` where torch has it, and warn about nothing."""
    errors = [e for e in spawn_cases(_warning_cases, 2)["warnings"] if e]
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, list[str]]]:
    return {world: spawn_cases(_cases, world) for world in WORLD_SIZES}


def _labels(world: int) -> list[str]:
    return [f"t={world}"] + (["t=2 of 4"] if world == 4 else [])


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel(results, world: int, case: str) -> None:
    for label in _labels(world):
        errors = [e for e in results[world][f"{label}:{case}"] if e]
        assert not errors, "\n".join(errors)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_with_executor(results) -> None:
    errors = [e for e in results[4]["ptd"] if e]
    assert not errors, "\n".join(errors)


def test_single_process_is_dense() -> None:
    """Without torch.distributed (t = 1) the layers are their dense counterparts."""
    torch.manual_seed(0)
    ref = nn.Linear(H, FFN)
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(H, FFN, None)
    x = _randn(0, B, S, H)
    assert torch.equal(col(x), ref(x))
    with pytest.raises(ConfigError, match="unknown linear kind"):
        tp.tp_linear_factory(None)(H, H, bias=True, kind="lm_head")
