"""Named model sizes as :class:`~pipewright.models.spec.ModelSpec` values.

- ``gpt3-*``: Brown et al. 2020, Table 2.1 (vocabulary 50257, sequence 2048). Two rows of that table are
  not whole head sizes; here GPT-3 XL takes 16 heads of 128 (the table's 24 heads × 128 ≠ 2048) and
  GPT-3 13B a hidden size of 5120 (the table's 5140 is not divisible by its 40 heads).
- ``megatron-*``: the ten models of Megatron-LM Table 1 (Narayanan et al. SC21; sequence 2048,
  vocabulary 51200), named by their parameter count.
- ``bert-base``, ``bert-large``: Devlin et al. 2019 (vocabulary 30522, sequence 512; PipeFisher's
  profiles use sequence 128 — ``resolve_model("bert-base", seq_len=128)``).
- ``llama3-8b``, ``llama3-70b``, ``llama3-405b``: Llama 3 (Dubey et al. 2024, Table 3: layers, hidden,
  FFN, heads, 8 key/value heads, vocabulary 128256, rotary base 500000; sequence 8192);
  ``llama-tiny``: a CPU-sized Llama (byte vocabulary).
- ``gpt-tiny``: the runtime's default run (byte vocabulary); ``gpt-small-cpu``: trains in minutes on a CPU.
- Mixtures of experts: ``mixtral-8x7b`` (Jiang et al. 2024: 32 layers, hidden 4096, 32 heads, 8 kv
  heads, 8 SwiGLU experts of 14336, top-2, vocabulary 32000, rotary base 10⁶; sequence 4096);
  ``deepseek-v3`` (DeepSeek-AI 2024, its published dimensions: 61 layers, hidden 7168, 128 heads,
  first 3 layers dense with FFN 18432, then 256 routed experts of 2048, top-8, plus 1 shared expert;
  vocabulary 129280, sequence 4096; multi-head latent attention and one multi-token-prediction module,
  both the cost model's only: the runtime builds ordinary attention and no prediction module);
  ``gpt-moe-tiny``, ``llama-moe-tiny``: CPU-sized, for tests.

``resolve_model("gpt", layers=…, hidden=…, heads=…, vocab=…, seq_len=…)`` builds a spec from a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

FAMILIES = ("gpt", "bert", "llama")
DIMENSIONS = ("layers", "hidden", "heads", "vocab", "seq_len")
OPTIONAL_DIMENSIONS = ("ffn_hidden", "kv_heads")
#: the mixture-of-experts fields of ModelSpec a preset's values may be overridden with
MOE_FIELDS = (
    "moe_experts",
    "moe_top_k",
    "moe_shared_experts",
    "moe_ffn_hidden",
    "moe_dense_layers",
    "moe_capacity",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
)
#: fields only the cost model reads (the attention kind, multi-token-prediction modules)
COST_FIELDS = ("attention_kind", "mtp_depth")
LLAMA3_VOCAB, LLAMA3_SEQ = 128256, 8192

#: Llama 3 (Table 3 of "The Llama 3 Herd of Models"): (name, layers, hidden, ffn, heads, kv heads)
_LLAMA3 = (
    ("llama3-8b", 32, 4096, 14336, 32, 8),
    ("llama3-70b", 80, 8192, 28672, 64, 8),
    ("llama3-405b", 126, 16384, 53248, 128, 8),
)
MEGATRON_VOCAB = 51200
MEGATRON_SEQ = 2048

#: Megatron-LM Table 1: (name, heads, hidden, layers)
_MEGATRON = (
    ("megatron-1.7b", 24, 2304, 24),
    ("megatron-3.6b", 32, 3072, 30),
    ("megatron-7.5b", 32, 4096, 36),
    ("megatron-18.4b", 48, 6144, 40),
    ("megatron-39.1b", 64, 8192, 48),
    ("megatron-76.1b", 80, 10240, 60),
    ("megatron-145.6b", 96, 12288, 80),
    ("megatron-310.1b", 128, 16384, 96),
    ("megatron-529.6b", 128, 20480, 105),
    ("megatron-1t", 160, 25600, 128),
)

#: GPT-3 (Table 2.1): (name, layers, hidden, heads)
_GPT3 = (
    ("gpt3-small", 12, 768, 12),
    ("gpt3-medium", 24, 1024, 16),
    ("gpt3-large", 24, 1536, 16),
    ("gpt3-xl", 24, 2048, 16),
    ("gpt3-2.7b", 32, 2560, 32),
    ("gpt3-6.7b", 32, 4096, 32),
    ("gpt3-13b", 40, 5120, 40),
    ("gpt3-175b", 96, 12288, 96),
)


def _presets() -> Mapping[str, ModelSpec]:
    specs = [ModelSpec(n, l, h, a, 50257, 2048) for n, l, h, a in _GPT3]
    specs += [ModelSpec(n, l, h, a, MEGATRON_VOCAB, MEGATRON_SEQ) for n, a, h, l in _MEGATRON]
    specs += [
        ModelSpec("bert-base", 12, 768, 12, 30522, 512, family="bert", tied_embeddings=True),
        ModelSpec("bert-large", 24, 1024, 16, 30522, 512, family="bert", tied_embeddings=True),
        ModelSpec("gpt-tiny", 4, 64, 4, 256, 64),
        ModelSpec("gpt-small-cpu", 4, 128, 4, 256, 128),
    ]
    specs += [
        ModelSpec(n, l, h, a, LLAMA3_VOCAB, LLAMA3_SEQ, ffn_hidden=f, family="llama", kv_heads=g)
        for n, l, h, f, a, g in _LLAMA3
    ]
    specs.append(ModelSpec("llama-tiny", 4, 128, 4, 256, 128, ffn_hidden=352, family="llama", kv_heads=2))
    specs += [
        ModelSpec(
            "mixtral-8x7b", 32, 4096, 32, 32000, 4096, ffn_hidden=14336, family="llama", kv_heads=8,
            rope_theta=1e6, moe_experts=8, moe_top_k=2,
        ),
        ModelSpec(
            "deepseek-v3", 61, 7168, 128, 129280, 4096, ffn_hidden=18432, family="llama", rope_theta=10000.0,
            moe_experts=256, moe_top_k=8, moe_shared_experts=1, moe_ffn_hidden=2048, moe_dense_layers=3,
            moe_aux_loss_coeff=0.0001, attention_kind="mla", mtp_depth=1,
        ),
        ModelSpec("gpt-moe-tiny", 4, 32, 4, 256, 16, moe_experts=4, moe_top_k=2),
        ModelSpec(
            "llama-moe-tiny", 4, 32, 4, 256, 16, ffn_hidden=64, family="llama", kv_heads=2,
            moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=32, moe_dense_layers=1,
        ),
    ]  # fmt: skip
    return MappingProxyType({s.name: s for s in specs})


PRESETS: Mapping[str, ModelSpec] = _presets()


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name``; one-line ConfigError listing the presets on a typo."""
    try:
        return PRESETS[name]
    except KeyError:
        presets, families = ", ".join(PRESETS), ", ".join(FAMILIES)
        raise ConfigError(
            f"unknown model {name!r}; choose a preset ({presets}) or a family ({families})"
        ) from None


def resolve_model(name: str, **overrides: int | None) -> ModelSpec:
    """A preset with ``overrides`` applied (``None`` values ignored), or a family ("gpt", "bert",
    "llama") whose dimensions all come from ``overrides`` (layers, hidden, heads, vocab, seq_len;
    ffn_hidden and kv_heads optional)."""
    unknown = set(overrides) - {*DIMENSIONS, *OPTIONAL_DIMENSIONS, *MOE_FIELDS, *COST_FIELDS}
    if unknown:
        raise ConfigError(f"unknown model dimension(s) {', '.join(sorted(unknown))}")
    if name in FAMILIES:
        missing = [d for d in DIMENSIONS if overrides.get(d) is None]
        if missing:
            flags = " ".join(f"--{d.replace('_', '-')}" for d in missing)
            raise ConfigError(f"model family {name!r} needs {flags}")
        kept = (*MOE_FIELDS, *COST_FIELDS)  # not cast to int
        dims = {k: v if k in kept else int(v) for k, v in overrides.items() if v is not None}
        spec = ModelSpec(name=name, family=name, tied_embeddings=name == "bert", **dims)
    else:
        base = get_preset(name)
        if overrides.get("ffn_hidden") is None and base.ffn_hidden == 4 * base.hidden:
            overrides = {**overrides, "ffn_hidden": 4 * (overrides.get("hidden") or base.hidden)}
        if (
            overrides.get("heads") is not None
            and overrides.get("kv_heads") is None
            and base.kv_heads == base.heads
        ):
            overrides = {**overrides, "kv_heads": overrides["heads"]}  # keep multi-head attention
        spec = base.with_overrides(**overrides)
    for dim in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_hidden"):  # before dividing by them
        if getattr(spec, dim) < 1:
            raise ConfigError(f"--{dim.replace('_', '-')} must be at least 1 (got {getattr(spec, dim)})")
    if spec.hidden % spec.heads:
        raise ConfigError(f"--hidden {spec.hidden} is not divisible by --heads {spec.heads}")
    if spec.kv_heads < 1 or spec.heads % spec.kv_heads:
        raise ConfigError(f"--heads {spec.heads} is not divisible by --kv-heads {spec.kv_heads}")
    if spec.kv_heads != spec.heads and spec.family != "llama":
        raise ConfigError("--kv-heads (grouped-query attention) needs --model llama (or a llama preset)")
    return spec
