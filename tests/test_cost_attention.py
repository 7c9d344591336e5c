"""TransformerCost(attention="flash"): no a·s² score storage or traffic, the scores recomputed in the
backward; the default stays the eager formula. The paper's vocabulary setting fits 80 GiB at 4096
with it."""

import pytest

from pipewright.cost import Efficiency, Mesh, TransformerCost
from pipewright.errors import ConfigError
from pipewright.features.vocab.experiment import paper_model, run
from pipewright.ir import Action, B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.schedules.registry import build_schedule
from pipewright.topology import cluster

SPEC = ModelSpec("t", layers=8, hidden=256, heads=8, vocab=1000, seq_len=128)


def test_default_is_eager():
    assert TransformerCost(SPEC).attention == "eager"
    with pytest.raises(ConfigError, match="attention must be one of eager, flash"):
        TransformerCost(SPEC, attention="sdpa")


@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (2, True)])
def test_flash_activation_bytes_drop_the_score_term(t, sp):
    s, b, h, a = SPEC.seq_len, 2, SPEC.hidden, SPEC.heads
    schedule = build_schedule("1f1b", 4, 4)  # stage 1: two layers, nothing else
    kw = dict(microbatch=b, dtype="fp16", mesh=Mesh(tp=t), sequence_parallel=sp)
    flash = TransformerCost(SPEC, attention="flash", **kw)
    eager = TransformerCost(SPEC, **kw)
    per_layer = 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)  # Korthikanti's selective formula
    assert flash.activation_bytes(Action(1, F, 0), schedule) == pytest.approx(2 * per_layer)  # bytes
    forward = Action(1, F, 0)
    diff = eager.activation_bytes(forward, schedule) - flash.activation_bytes(forward, schedule)
    assert diff == pytest.approx(2 * 5 * a * s * s * b / t)  # two layers × 5·a·s²·b/t bytes
    frees = sum(flash.activation_bytes(Action(1, k, 0), schedule) for k in (I, W))
    assert frees == pytest.approx(-flash.activation_bytes(Action(1, F, 0), schedule))


def test_flash_recomputes_the_scores_in_the_backward():
    s, b, h = SPEC.seq_len, 2, SPEC.hidden
    schedule = build_schedule("1f1b", 4, 4)
    flash = TransformerCost(SPEC, microbatch=b, attention="flash")
    eager = TransformerCost(SPEC, microbatch=b)
    for kind, extra in ((F, 0), (B, 2 * 2 * b * s * s * h), (I, 2 * 2 * b * s * s * h), (W, 0)):
        act = Action(1, kind, 0)
        assert flash.flops(act, schedule) - eager.flops(act, schedule) == pytest.approx(extra)
        assert flash.model_flops(act, schedule) == eager.model_flops(act, schedule)


def test_flash_removes_the_score_traffic():
    s, b, a = SPEC.seq_len, 1, SPEC.heads
    schedule = build_schedule("1f1b", 4, 4)
    eff = Efficiency(gemm=1e9, memory_traffic=2.0, comm=1.0)  # time ≈ memory traffic only
    kw = dict(microbatch=b, efficiency=eff, mesh=Mesh(pp=4), topology=cluster(1, 8))
    flash, eager = TransformerCost(SPEC, attention="flash", **kw), TransformerCost(SPEC, **kw)
    bandwidth = eager.topology.accelerator(eager.comm.device(1)).memory_bandwidth
    saved = eager.compute_time(Action(1, F, 0), schedule) - flash.compute_time(Action(1, F, 0), schedule)
    # F recomputes nothing; its traffic shrinks by κ · 2 layers · 5·a·s²·b bytes (bf16)
    assert saved == pytest.approx(2.0 * 2 * 5 * a * s * s * b / bandwidth, rel=1e-6)


def test_paper_setting_at_4096_fits_80_gib_with_flash():
    """Sequence 4096, V = 256k (the largest activations and output layer): every method's peak memory
    under 80 GiB with flash attention (16 microbatches: the same in-flight count as 128 on 1F1B)."""
    spec = paper_model(256 * 1024, 4096)
    for method in ("naive", "alg1", "alg2"):
        flash = run(method, spec, microbatches=16, attention="flash")
        assert flash.peak_memory_gib < 80, method
        eager = run(method, spec, microbatches=16, attention="eager")
        assert eager.peak_memory_gib > 80, method
