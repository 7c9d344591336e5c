"""The training options through the real trainer, on 4 gloo processes (one forked launch, one mesh per
shape shared by all cases; tiny models):

- recomputation: ``selective`` and ``full`` give the loss and every gradient of ``none`` within 1e-6
  relative, for every synchronous schedule (pp = 4, incl. the split-backward and V-shape ones) and
  under tensor parallelism (pp = 2, tp = 2, with sequence parallelism);
- embeddings tied across the first and the last stage (pp = 2 with dp = 2, pp = 4, a V-shape where one
  rank holds both, tp = 2): loss, gradients and parameters after 3 SGD steps equal the single-process
  tied model within 1e-5;
- ZeRO-1 at dp = 2 (pp = 2): parameters after 5 steps (SGD and AdamW, clipping active) equal the
  unsharded run within 1e-5 with the same losses; the optimizer state per rank halves; a sharded
  checkpoint written after 3 steps and resumed gives the straight run's parameters;
- the Llama model (grouped-query attention) at pp = 4, and pp = 2 with tp = 2 (with and without
  sequence parallelism): loss, gradients and parameters after 3 steps equal one process within 1e-5;
- bf16 and fp16 (dynamic loss scaling), also with ZeRO-1 and fp32 gradient reduction: master weights
  and optimizer state are fp32, the stages compute in the low dtype, and the losses of 5 steps stay
  within 2 % of fp32's;
- Hugging Face checkpoints (GPT-2 layout with the ``transformer.`` prefix and no ``lm_head``; Llama
  layout in two safetensors shards with an index) written here load into pp = 2 (tp = 2 for Llama)
  and give one process's logits; each pipeline rank reads only its own layers' tensors.

Llama at pp = 4 × tp = 2 (8 processes, about 20 s on a quiet machine) runs in its own launch.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _queue_spawn import fork_launch
from _single_process import single_process
from pipewright.data.tokens import write_tokens
from pipewright.errors import PipewrightError
from pipewright.models.family import build_full
from pipewright.models.hf_load import load_hf_stage_, read_hf_spec
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import full_parameters
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import schedule_names
from pipewright.schedules.registry import check_args, info
from pipewright.training import prepare

WORLD = 4
REF_RTOL = 1e-5
RECOMPUTE_RTOL = 1e-6


def _base(data: str) -> TrainConfig:
    return TrainConfig(
        layers=4, hidden=32, heads=4, vocab=256, seq_len=16, microbatch_size=1, microbatches=4, steps=3,
        lr=0.05, warmup=1, grad_clip=0.5, optimizer="sgd", data=data, progress=False, artifacts=False,
        eval_every=0, recv_timeout_s=120, pp=4,
    )  # fmt: skip


def _accepts(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_args(name, p, m, v)
    except PipewrightError:
        return False
    return True


def _sync_schedules(pp: int) -> list[tuple[str, int, int]]:
    """(name, v, m) for every synchronous schedule at ``pp`` (v = 2 where it takes chunks)."""
    out = []
    for name in schedule_names(distinct_orders=True):
        entry = info(name)
        if not entry.synchronous:
            continue
        v = 2 if entry.chunks is None else (1 if 1 in entry.chunks else entry.chunks[0])
        m = next((m for m in (4, 8) if _accepts(name, pp, m, v)), None)
        if m is not None:
            out.append((name, v, m))
    return out


# ------------------------------------------------------------------------------------------ cases


def _cases(data: str, hf: dict[str, str]) -> list[tuple[str, TrainConfig]]:
    base = _base(data)
    cases: list[tuple[str, TrainConfig]] = []
    for name, v, m in _sync_schedules(4):  # recomputation, every synchronous schedule
        layers = 4 * v
        for mode in ("none", "selective", "full"):
            config = replace(base, schedule=name, virtual=v, microbatches=m, layers=layers, steps=1)
            cases.append((f"recompute:{name}:{mode}", replace(config, recompute=mode)))
    for sp in (False, True):  # recomputation under tensor parallelism (collectives recomputed in I)
        for mode in ("none", "full", "selective"):
            config = replace(
                base, schedule="zb-h1", pp=2, tp=2, steps=1, sequence_parallel=sp, recompute=mode
            )
            cases.append((f"recompute:zb-h1-tp{'-sp' if sp else ''}:{mode}", config))
    tied = replace(base, tie_embeddings=True)
    cases += [
        ("tied:1f1b-pp2-dp2", replace(tied, pp=2, dp=2)),
        ("tied:1f1b-pp4", tied),
        ("tied:zbv-pp2", replace(tied, pp=2, dp=2, schedule="zbv", virtual=2)),
        ("tied:zb-h1-pp2-tp2", replace(tied, pp=2, tp=2, schedule="zb-h1")),
    ]
    zero = replace(base, pp=2, dp=2, steps=5, schedule="1f1b")
    for opt in ("sgd", "adamw"):
        config = replace(zero, optimizer=opt, lr=0.01 if opt == "adamw" else 0.05)
        cases += [
            (f"zero:{opt}:plain", config),
            (f"zero:{opt}:sharded", replace(config, shard_optimizer=True)),
        ]
    cases.append(("zero:sgd:resume", replace(zero, shard_optimizer=True)))
    llama = replace(base, model="llama", kv_heads=2, ffn_hidden=64)
    cases += [
        ("llama:pp4", replace(llama, schedule="zb-h1")),
        ("llama:pp2-tp2", replace(llama, pp=2, tp=2)),
        ("llama:pp2-tp2-sp", replace(llama, pp=2, tp=2, sequence_parallel=True, schedule="zbv", virtual=2)),
    ]
    mixed = replace(base, pp=2, dp=2, steps=5, optimizer="adamw", lr=0.003)
    cases += [
        ("precision:fp32", mixed),
        ("precision:bf16", replace(mixed, precision="bf16")),
        ("precision:bf16-zero", replace(mixed, precision="bf16", shard_optimizer=True, reduce_fp32=True)),
        ("precision:fp16", replace(mixed, precision="fp16", schedule="zb-h1")),
        ("precision:bf16-llama-full", replace(mixed, precision="bf16", model="llama", recompute="full")),
        ("precision:fp32-llama", replace(mixed, model="llama")),
        # the same as precision:bf16 and precision:fp16 but sharded (reduce-scattered in bf16/fp16)
        ("zero:bf16:sharded", replace(mixed, precision="bf16", shard_optimizer=True)),
        ("zero:fp16:sharded", replace(mixed, precision="fp16", schedule="zb-h1", shard_optimizer=True)),
    ]
    hf_base = replace(base, layers=None, hidden=None, heads=None, vocab=None, steps=1, pp=2)
    cases += [
        ("hf:gpt2", replace(hf_base, dp=2, init_from=hf["gpt2"])),
        ("hf:llama", replace(hf_base, tp=2, init_from=hf["llama"], model="llama")),
    ]
    return cases


# ------------------------------------------------------------------------------------------ worker


def _full(trainer: Trainer, grad: bool) -> dict[str, torch.Tensor]:
    return {
        name: t.float().clone()
        for stage in trainer.stages.values()
        for name, t in full_parameters(stage, grad=grad).items()
    }


def _logits(trainer: Trainer, x: torch.Tensor) -> torch.Tensor | None:
    """Logits of ``x`` through the pipeline (blocking p2p as Trainer.evaluate), vocab shards gathered."""
    sched, mesh = trainer.schedule, trainer.mesh
    hidden, out = x, None
    with torch.no_grad():
        for s in trainer.stages:
            if s > 0 and sched.rank_of(s - 1) != mesh.pp_rank:
                shape = (x.shape[0], *trainer.boundary_shape[1:])
                hidden = torch.empty(shape, dtype=trainer.options.dtype)
                dist.recv(hidden, src=mesh.pp_peer(sched.rank_of(s - 1)))
            hidden = trainer.stages[s](hidden)
            if s == sched.num_stages - 1:
                out = hidden
            elif sched.rank_of(s + 1) != mesh.pp_rank:
                dist.send(hidden.contiguous(), dst=mesh.pp_peer(sched.rank_of(s + 1)))
    if out is not None and mesh.tp > 1:
        parts = [torch.empty_like(out) for _ in range(mesh.tp)]
        dist.all_gather(parts, out.contiguous(), group=mesh.tp_group)
        out = torch.cat(parts, dim=-1)
    return out


def _run_case(label: str, run: PreparedRun, mesh: ParallelMesh) -> dict:
    c = run.config
    trainer = Trainer(run, mesh=mesh)
    result: dict = {}
    if label.startswith("hf:"):
        x = torch.arange(2 * run.spec.seq_len).reshape(2, -1) % run.spec.vocab
        result["logits"] = _logits(trainer, x)
        result["keys"] = sorted(trainer.options.keys_read)
        result["stages"] = sorted(trainer.stages)
        return result
    if label.startswith("precision:"):
        result["model_dtypes"] = sorted({str(p.dtype) for p in trainer.params.values()})
        opt = trainer.optimizer
        result["master_dtypes"] = sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]})
    losses = [trainer.forward_backward(0)]
    if trainer.master is not None and trainer.master.shard:  # only slices are reduced: gather them
        trainer.master.gather_grads_()
    result["grads"] = _full(trainer, grad=True)
    if label.startswith("precision:"):
        result["boundary_dtype"] = str(trainer.executor._dtypes.get(1))
    norms = [trainer.optimizer_step(0)[1]]
    if label == "zero:sgd:resume":  # stop after 3 steps with a checkpoint, resume in a new trainer
        for step in range(1, 3):
            losses.append(trainer.forward_backward(step))
            trainer.optimizer_step(step)
        trainer.save(3)
        trainer = Trainer(run, mesh=mesh)
        assert trainer.load(run.out_dir / "checkpoints" / "step_3") == 3
    for step in range(len(losses), c.steps):
        with _dp_collectives(mesh.dp_group) if step == 1 else nullcontext() as calls:
            losses.append(trainer.forward_backward(step))
            norms.append(trainer.optimizer_step(step)[1])
        if step == 1 and label.startswith("zero:sgd:"):
            result["dp_calls"] = calls
            flats = trainer.master.flats if trainer.master is not None else []
            result["padded_bytes"] = [mesh.dp * f.size * 4 for f in flats if f.params]
    result["norms"] = norms
    if label.startswith("precision:"):
        result["state_dtypes"] = sorted(
            {str(v.dtype) for st in trainer.optimizer.state.values() for v in st.values() if v.ndim > 0}
        )
    result["state_bytes"] = sum(
        v.numel() * v.element_size()
        for st in trainer.optimizer.state.values()
        for v in st.values()
        if v.ndim > 0
    )
    result["losses"] = losses
    result["params"] = _full(trainer, grad=False)
    if label == "precision:fp16":  # the dynamic loss scale survives a checkpoint
        trainer.options.scaler.load_state({"scale": 1024.0, "good_steps": 7, "skipped": 2})
        trainer.save(c.steps)
        again = Trainer(run, mesh=mesh)
        again.load(run.out_dir / "checkpoints" / f"step_{c.steps}")
        result["scaler"] = again.options.scaler.state()
    return result


@contextmanager
def _dp_collectives(group):
    """Every collective over ``group`` while inside: {name: [bytes sent in, per call]}."""
    calls: dict[str, list[int]] = {}
    names = (
        "all_reduce",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_gather",
        "all_gather_into_tensor",
    )
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counted(name, fn):
        def call(*args, **kwargs):
            if kwargs.get("group") is group:
                tensors = args[0] if name == "all_gather" else args[1] if "scatter" in name else args[0]
                size = sum(
                    t.numel() * t.element_size() for t in ([tensors] if torch.is_tensor(tensors) else tensors)
                )
                short = name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
                calls.setdefault(short, []).append(size)
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _worker(rank: int, runs: list[tuple[str, PreparedRun]]) -> list | None:
    torch.set_num_threads(1)
    meshes: dict[tuple[int, int, int], ParallelMesh] = {}
    out = []
    for label, run in runs:
        c = run.config
        if (c.dp, c.pp, c.tp) not in meshes:
            meshes[c.dp, c.pp, c.tp] = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp)
        start = time.perf_counter()
        result = _run_case(label, run, meshes[c.dp, c.pp, c.tp])
        result["seconds"] = time.perf_counter() - start
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        out.append(gathered)
    return out if rank == 0 else None


# ------------------------------------------------------------------------------------------ references


def _reference(run: PreparedRun) -> dict:
    """One process, whole global batch, the same optimizer, learning rates and clipping."""
    ref = single_process(run.config, run.spec, eval_batches=0)
    return {"losses": ref.losses, "grads": ref.grads0, "params": ref.params}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm()) / (float(want.float().norm()) + 1e-12)


def _merge(gathered: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Every rank's tensors by name (each name from any rank holding it; tied copies keep both names)."""
    merged: dict[str, torch.Tensor] = {}
    for result in gathered:
        merged.update(result.get(key) or {})
    return merged


def _check_against(gathered: list[dict], ref: dict, rtol: float, label: str, failures: list[str]) -> None:
    losses = gathered[0]["losses"]
    if not np.allclose(losses, ref["losses"][: len(losses)], rtol=rtol, atol=0):
        failures.append(f"{label}: losses {losses} != {ref['losses']}")
    for key in ("grads", "params"):
        got = _merge(gathered, key)
        for name, want in ref[key].items():
            if name not in got:
                failures.append(f"{label}: no {key} for {name}")
            elif _rel(got[name], want) > rtol:
                failures.append(f"{label}: {key} of {name} differs by {_rel(got[name], want):.2e}")
        tied_copy = "head.out.weight" in got and "head.out.weight" not in ref[key]
        if tied_copy and _rel(got["head.out.weight"], ref[key]["embed.tok.weight"]) > rtol:
            failures.append(f"{label}: the tied output copy's {key} differ from the embedding's")


# ------------------------------------------------------------------------------------------ the test


def _write_hf(root, data_vocab: int = 256) -> dict[str, str]:
    """A GPT-2-layout and a Llama-layout checkpoint with random weights (no download)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)

    def rnd(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    gpt = root / "gpt2"
    gpt.mkdir()
    h, layers, V, pos = 32, 4, data_vocab, 32
    tensors = {"transformer.wte.weight": rnd(V, h), "transformer.wpe.weight": rnd(pos, h)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        tensors |= {
            p + "ln_1.weight": 1 + rnd(h), p + "ln_1.bias": rnd(h),
            p + "attn.c_attn.weight": rnd(h, 3 * h), p + "attn.c_attn.bias": rnd(3 * h),
            p + "attn.c_proj.weight": rnd(h, h), p + "attn.c_proj.bias": rnd(h),
            p + "ln_2.weight": 1 + rnd(h), p + "ln_2.bias": rnd(h),
            p + "mlp.c_fc.weight": rnd(h, 4 * h), p + "mlp.c_fc.bias": rnd(4 * h),
            p + "mlp.c_proj.weight": rnd(4 * h, h), p + "mlp.c_proj.bias": rnd(h),
        }  # fmt: skip
    tensors |= {"transformer.ln_f.weight": 1 + rnd(h), "transformer.ln_f.bias": rnd(h)}
    save_file(tensors, str(gpt / "model.safetensors"))
    config = {"model_type": "gpt2", "n_layer": layers, "n_embd": h, "n_head": 4, "vocab_size": V}
    (gpt / "config.json").write_text(json.dumps(config | {"n_positions": pos}))

    llama = root / "llama"
    llama.mkdir()
    f, kv = 64, 2 * (h // 4)
    shards: list[dict] = [{}, {}]
    shards[0]["model.embed_tokens.weight"] = rnd(V, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shards[i * 2 // layers] |= {
            p + "input_layernorm.weight": 1 + rnd(h), p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
            p + "mlp.down_proj.weight": rnd(h, f),
        }  # fmt: skip
    shards[1] |= {"model.norm.weight": 1 + rnd(h), "lm_head.weight": rnd(V, h)}
    weight_map = {}
    for j, shard in enumerate(shards):
        name = f"model-0000{j + 1}-of-00002.safetensors"
        save_file(shard, str(llama / name))
        weight_map |= dict.fromkeys(shard, name)
    (llama / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "model_type": "llama", "num_hidden_layers": layers, "hidden_size": h, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": f, "vocab_size": V, "max_position_embeddings": 16,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    (llama / "config.json").write_text(json.dumps(config))
    return {"gpt2": str(gpt), "llama": str(llama)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    data = root / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    hf = _write_hf(root)
    runs = []
    for i, (label, config) in enumerate(_cases(str(data), hf)):
        assert config.world_size == WORLD, label
        runs.append((label, prepare(replace(config, out=str(root / f"run{i}")))))
    gathered = fork_launch(_worker, WORLD, (runs,), timeout_s=900)[0]
    return {label: (run, g) for (label, run), g in zip(runs, gathered, strict=True)}


@pytest.mark.slow
def test_recomputation_equals_none(results):
    failures, seen = [], set()
    for label, (_, gathered) in results.items():
        kind, name, mode = [*label.split(":"), "", ""][:3]
        if kind != "recompute" or mode == "none":
            continue
        seen.add((name, mode))
        _, base = results[f"recompute:{name}:none"]
        ref = {"losses": base[0]["losses"], "grads": _merge(base, "grads"), "params": _merge(base, "params")}
        _check_against(gathered, ref, RECOMPUTE_RTOL, label, failures)
    names = {n for n, _ in seen}
    assert {"zb-h1", "zbv", "1f1b", "interleaved-1f1b", "gpipe"} <= names
    assert len(seen) >= 2 * len(_sync_schedules(4))
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_tied_embeddings_across_stages_equal_one_process(results):
    failures = []
    tied = [label for label in results if label.startswith("tied:")]
    for label in tied:
        run, gathered = results[label]
        assert run.spec.tied_embeddings
        _check_against(gathered, _reference(run), REF_RTOL, label, failures)
        # both copies exist somewhere (the embedding and the last stage's output layer)
        assert "head.out.weight" in _merge(gathered, "params"), label
    assert len(tied) == 4
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_zero1_equals_unsharded(results):
    failures = []
    for opt in ("sgd", "adamw"):
        _, plain = results[f"zero:{opt}:plain"]
        _, sharded = results[f"zero:{opt}:sharded"]
        ref = {
            "losses": plain[0]["losses"],
            "grads": _merge(plain, "grads"),
            "params": _merge(plain, "params"),
        }
        _check_against(sharded, ref, REF_RTOL, f"zero:{opt}", failures)
        if opt == "adamw":  # Adam's two moments: 1/dp of them per rank
            for p, s in zip(plain, sharded, strict=True):
                assert 0 < s["state_bytes"] <= 0.55 * p["state_bytes"], (s["state_bytes"], p["state_bytes"])
    _, plain = results["zero:sgd:plain"]
    _, resumed = results["zero:sgd:resume"]
    ref = {"losses": plain[0]["losses"], "grads": _merge(plain, "grads"), "params": _merge(plain, "params")}
    _check_against(resumed, ref, REF_RTOL, "zero:sgd:resume", failures)
    # the unsharded SGD run itself equals one process (so the sharded one does too)
    run, _ = results["zero:sgd:plain"]
    _check_against(plain, _reference(run), REF_RTOL, "zero:sgd:plain vs one process", failures)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_zero1_reduce_scatters_the_gradients(results):
    """Sharded bf16/fp16 (clipping active) equal unsharded; the sharded step's dp collectives are a
    reduce-scatter of the padded gradient buffer and an all-gather of the parameters (plus the loss'
    and the norm's scalars), where unsharded all-reduces the gradients."""
    failures = []
    for low, plain in (("bf16", "precision:bf16"), ("fp16", "precision:fp16")):
        _, want = results[plain]
        _, got = results[f"zero:{low}:sharded"]
        ref = {"losses": want[0]["losses"], "grads": _merge(want, "grads"), "params": _merge(want, "params")}
        _check_against(got, ref, REF_RTOL, f"zero:{low}", failures)
        finite = [n for n in got[0]["norms"] if np.isfinite(n)]  # fp16: inf on a skipped step
        assert finite and max(finite) > 0.5, got[0]["norms"]  # --grad-clip 0.5 clipped
        np.testing.assert_allclose(got[0]["norms"], want[0]["norms"], rtol=REF_RTOL)
    assert not failures, "\n".join(failures[:20])
    for plain, sharded in zip(results["zero:sgd:plain"][1], results["zero:sgd:sharded"][1], strict=True):
        padded = sharded["padded_bytes"]
        assert sharded["dp_calls"] == {"all_reduce": [16, 8], "reduce_scatter": padded, "all_gather": padded}
        grads = sum(plain["dp_calls"]["all_reduce"]) - 16  # less the loss
        assert set(plain["dp_calls"]) == {"all_reduce"} and 0 <= sum(padded) - grads < 2 * 2 * 4


@pytest.mark.slow
def test_llama_equals_one_process(results):
    failures = []
    for label in ("llama:pp4", "llama:pp2-tp2", "llama:pp2-tp2-sp"):
        run, gathered = results[label]
        assert run.spec.family == "llama" and run.spec.kv_heads == 2
        _check_against(gathered, _reference(run), REF_RTOL, label, failures)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_mixed_precision_keeps_fp32_masters_and_tracks_fp32(results):
    fp32 = results["precision:fp32"][1][0]["losses"]
    llama32 = results["precision:fp32-llama"][1][0]["losses"]
    for label, low in (
        ("precision:bf16", "torch.bfloat16"),
        ("precision:bf16-zero", "torch.bfloat16"),
        ("precision:fp16", "torch.float16"),
        ("precision:bf16-llama-full", "torch.bfloat16"),
    ):
        _, gathered = results[label]
        for r in gathered:
            assert r["model_dtypes"] == [low], label
            assert r["master_dtypes"] == ["torch.float32"], label
            assert r["state_dtypes"] == ["torch.float32"], label
            assert r["boundary_dtype"] == low, label
        want = llama32 if "llama" in label else fp32
        np.testing.assert_allclose(gathered[0]["losses"], want, rtol=0.02, err_msg=label)
    for r in results["precision:fp16"][1]:
        assert r["scaler"] == {"scale": 1024.0, "good_steps": 7, "skipped": 2}
    assert results["precision:fp32"][1][0]["losses"][-1] < fp32[0]


@pytest.mark.slow
def test_hf_checkpoint_loads_into_pp2_with_one_process_logits(results):
    for label in ("hf:gpt2", "hf:llama"):
        run, gathered = results[label]
        folder = run.config.init_from
        spec = read_hf_spec(folder, seq_len=run.spec.seq_len)
        assert spec == run.spec
        model = build_full(spec, seed=123)  # other random weights, all overwritten by the checkpoint
        load_hf_stage_(model, folder, spec)
        x = torch.arange(2 * spec.seq_len).reshape(2, -1) % spec.vocab
        with torch.no_grad():
            want = model(x)
        logits = [r["logits"] for r in gathered if r["logits"] is not None]
        assert logits, label
        for got in logits:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # each pipeline rank read only its own layers (layers 0-1 on stage 0, 2-3 on stage 1)
        for r in gathered:
            layers = {int(k.split(".")[k.split(".").index("h" if "gpt2" in label else "layers") + 1])
                      for k in r["keys"] if ".h." in k or ".layers." in k}  # fmt: skip
            assert layers == ({0, 1} if r["stages"] == [0] else {2, 3}), (label, r["stages"], r["keys"])


@pytest.mark.slow
def test_llama_pp4_tp2_equals_one_process(tmp_path):
    """Llama at pp = 4 × tp = 2 (8 processes): plain 1F1B, and zb-h1 with sequence parallelism and full
    recomputation, against one process (loss, gradients, parameters after 3 steps, 1e-5)."""
    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    base = replace(_base(str(data)), model="llama", kv_heads=2, ffn_hidden=64, pp=4, tp=2)
    cases = [
        ("llama:pp4-tp2", replace(base, schedule="1f1b")),
        ("llama:pp4-tp2-sp-full", replace(base, schedule="zb-h1", sequence_parallel=True, recompute="full")),
    ]
    runs = [(label, prepare(replace(c, out=str(tmp_path / f"r{i}")))) for i, (label, c) in enumerate(cases)]
    failures: list[str] = []
    for (label, run), gathered in zip(runs, fork_launch(_worker, 8, (runs,), timeout_s=900)[0], strict=True):
        _check_against(gathered, _reference(run), REF_RTOL, label, failures)
    assert not failures, "\n".join(failures[:20])
