"""The GPT model and layouts: parser, layout-independent initialisation, stage allocation, gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.errors import ConfigError
from pipewright.models.gpt import build_full, build_stage, loss_fn
from pipewright.models.layout import Layout, parse_layout, resolve_layout, uniform_layout
from pipewright.models.spec import ModelSpec

SPEC = ModelSpec("test", layers=4, hidden=32, heads=4, vocab=64, seq_len=16)


@st.composite
def layouts(draw) -> tuple[list[int], str]:
    counts = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    parts = []
    for i, n in enumerate(counts):
        if n == 0 and 0 < i < len(counts) - 1:  # only the E and L stages may hold no t
            counts[i] = n = 1
        body = "" if n == 0 else draw(st.sampled_from(["t" * n, f"t*{n}"]))
        parts.append(("E" if i == 0 else "") + body + ("L" if i == len(counts) - 1 else ""))
    return counts, "|".join(parts)


@given(layouts())
def test_parse_layout_roundtrip(case):
    counts, text = case
    layout = parse_layout(text)
    assert [len(s.layers) for s in layout.stages] == counts
    flat = [i for s in layout.stages for i in s.layers]
    assert flat == list(range(sum(counts)))  # global numbering, in order
    assert layout.stages[0].embedding and layout.stages[-1].head
    assert sum(s.embedding for s in layout.stages) == 1 and sum(s.head for s in layout.stages) == 1
    assert parse_layout(str(layout)) == layout


@given(st.text(alphabet="EtL|*0123x ", max_size=12))
@settings(max_examples=300)
def test_parse_layout_never_crashes(text):
    try:
        layout = parse_layout(text)
    except ConfigError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(layout, Layout) and layout.num_stages >= 1


@pytest.mark.parametrize(
    "text", ["", "t*4", "E|t*4", "t|EtL", "Et|L|t", "Et||tL", "EtLt", "Et*x|tL", "EEt|tL"]
)
def test_parse_layout_errors_are_one_line(text):
    with pytest.raises(ConfigError) as info:
        parse_layout(text)
    assert "\n" not in str(info.value)


@given(st.integers(1, 40), st.integers(1, 12))
def test_uniform_layout(layers, stages):
    if stages > layers:
        with pytest.raises(ConfigError, match="stages"):
            uniform_layout(layers, stages)
        return
    layout = uniform_layout(layers, stages)
    sizes = [len(s.layers) for s in layout.stages]
    assert layout.num_stages == stages and sum(sizes) == layers and max(sizes) - min(sizes) <= 1
    assert resolve_layout(str(layout), layers, stages) == layout


def test_resolve_layout_checks_counts():
    with pytest.raises(ConfigError, match="holds 3 transformer layers"):
        resolve_layout("Et|t*2L", 4, 2)
    with pytest.raises(ConfigError, match="pp × virtual"):
        resolve_layout("Et*2|t*2L", 4, 4)


def _params(module):
    return {n: p.detach() for n, p in module.named_parameters()}


def test_same_seed_same_weights_whatever_the_layout():
    full = _params(build_full(SPEC, seed=7))
    other = _params(build_full(SPEC, seed=8))
    assert not torch.equal(full["layers.0.attn.qkv.weight"], other["layers.0.attn.qkv.weight"])
    for text in ["E|t*4L", "Et|t|t|tL", "Et*3|tL", "E|t|t*2|tL"]:
        seen = set()
        for s in range(len(text.split("|"))):
            stage = _params(build_stage(SPEC, text, s, seed=7))
            for name, p in stage.items():
                assert torch.equal(p, full[name]), (text, name)
            seen |= stage.keys()
        assert seen == full.keys()


def test_build_stage_allocates_only_its_layers():
    stage = build_stage(SPEC, "Et|t*2|tL", 1, seed=0)
    assert stage.embed is None and stage.head is None
    assert list(stage.layers) == ["1", "2"]
    names = {n.split(".")[0] + "." + n.split(".")[1] for n, _ in stage.named_parameters()}
    assert names == {"layers.1", "layers.2"}
    per_layer = sum(p.numel() for p in build_stage(SPEC, "Et|t*2|tL", 1, seed=0).layers["1"].parameters())
    assert sum(p.numel() for p in stage.parameters()) == 2 * per_layer
    full = build_full(SPEC)
    assert sum(p.numel() for p in full.parameters()) == SPEC.num_parameters()


def test_default_linears_can_defer_weight_gradients():
    from pipewright.models.wgrad import DeferrableLinear

    model = build_full(SPEC)
    assert isinstance(model.layers["0"].attn.qkv, DeferrableLinear)
    assert isinstance(model.head.out, DeferrableLinear)


def test_linear_factory_sees_every_kind():
    seen = []

    def factory(i, o, *, bias, kind):
        seen.append(kind)
        return torch.nn.Linear(i, o, bias=bias)

    build_full(SPEC, linear_factory=factory)
    assert seen == ["qkv", "attn_out", "mlp_in", "mlp_out"] * SPEC.layers + ["output"]


def test_factory_hooks_build_the_embedding_from_the_same_init():
    """A factory with ``embedding`` (here the tensor-parallel one over a group of one process) builds the
    token table, which adds the position embeddings; the model is the default one, weight for weight
    and logit for logit."""
    from pipewright.runtime.parallel.tp import VocabParallelEmbedding, tp_linear_factory

    tp_model = build_full(SPEC, seed=2, linear_factory=tp_linear_factory(None, num_heads=SPEC.heads))
    model = build_full(SPEC, seed=2)
    assert isinstance(tp_model.embed.tok, VocabParallelEmbedding)
    ids = torch.randint(0, SPEC.vocab, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tp_model.embed.tok.weight, model.embed.tok.weight, rtol=0, atol=0)
    torch.testing.assert_close(tp_model(ids), model(ids), rtol=1e-6, atol=1e-6)


def test_tied_embeddings_one_parameter_on_one_stage_equal_copies_across_stages():
    tied = ModelSpec("t", layers=2, hidden=32, heads=4, vocab=64, seq_len=16, tied_embeddings=True)
    model = build_full(tied)
    assert model.head.out.weight is model.embed.tok.weight
    first, last = build_stage(tied, "Et|tL", 0), build_stage(tied, "Et|tL", 1)
    # across stages: the output layer's copy starts equal (runtime/parallel/tied.py keeps it equal)
    assert torch.equal(last.head.out.weight, first.embed.tok.weight)


def test_stages_compose_to_the_full_model_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randint(0, SPEC.vocab, (3, SPEC.seq_len))
    y = torch.randint(0, SPEC.vocab, (3, SPEC.seq_len))
    full = build_full(SPEC, seed=1)
    ref_loss = loss_fn(full(x), y)
    ref_loss.backward()
    assert abs(ref_loss.item() - torch.log(torch.tensor(float(SPEC.vocab))).item()) < 0.5  # ≈ uniform at init
    stages = [build_stage(SPEC, "Et|t*2|tL", s, seed=1) for s in range(3)]
    h = x
    for stage in stages:
        h = stage(h)
    loss = loss_fn(h, y)
    loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    ref = dict(full.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None and torch.allclose(p.grad, ref[name].grad, rtol=1e-4, atol=1e-7), name


def test_causal():
    model = build_full(SPEC, seed=2)
    x = torch.randint(0, SPEC.vocab, (1, SPEC.seq_len))
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % SPEC.vocab
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) and not torch.allclose(a[:, -1], b[:, -1])
