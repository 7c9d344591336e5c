"""Initial weights from a Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``, or
shards listed in ``model.safetensors.index.json``) of GPT-2 or Llama architecture.

:func:`read_hf_spec` turns ``config.json`` into a :class:`ModelSpec`; :func:`load_hf_stage_` copies the
tensors one stage module holds — and reads only those: ``safetensors.safe_open`` memory-maps the file
and ``get_tensor`` reads one tensor, so a pipeline rank never touches another stage's layers.
Tensor-parallel shards take their part of each full tensor through the layer's ``load_full_``.

Name maps (ours ← theirs; ``{i}`` a global layer index):

GPT-2 (``GPT2Model``/``GPT2LMHeadModel``, optional ``transformer.`` prefix; its ``Conv1D`` weights are
stored [in, out] and are transposed): ``embed.tok`` ← ``wte``, ``embed.pos`` ← the first s rows of
``wpe``, ``layers.{i}.ln_attn`` ← ``h.{i}.ln_1``, ``attn.qkv`` ← ``attn.c_attn``, ``attn.proj`` ←
``attn.c_proj``, ``ln_mlp`` ← ``ln_2``, ``mlp.fc_in`` ← ``mlp.c_fc``, ``mlp.fc_out`` ← ``mlp.c_proj``,
``head.norm`` ← ``ln_f``, ``head.out`` ← ``lm_head`` (or ``wte``: GPT-2 ties them). Note: GPT-2 uses the
tanh approximation of GELU, pipewright's GPT the exact one, so logits differ slightly from
``transformers``' (about 1e-3 relative).

Llama (``LlamaForCausalLM``): ``embed.tok`` ← ``model.embed_tokens``, ``layers.{i}.attn_norm`` ←
``model.layers.{i}.input_layernorm``, ``attn.{q,k,v,o}`` ← ``self_attn.{q,k,v,o}_proj``, ``mlp_norm`` ←
``post_attention_layernorm``, ``mlp.{gate,up,down}`` ← ``mlp.{gate,up,down}_proj``, ``head.norm`` ←
``model.norm``, ``head.out`` ← ``lm_head`` (or the embedding when ``tie_word_embeddings``). Both use the
"rotate half" rotary layout, so q/k rows are not permuted.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

log = logging.getLogger(__name__)

WEIGHTS, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"

_GPT2_LAYER = {
    "ln_attn": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "ln_mlp": "ln_2",
    "mlp.fc_in": "mlp.c_fc",
    "mlp.fc_out": "mlp.c_proj",
}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


def _read_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"--init-from {folder}: no {CONFIG}; give a Hugging Face checkpoint folder")
    return _json_file(path)


def _json_file(path: Path) -> dict:
    """A JSON object from ``path``; one line naming the file when it is not UTF-8 or not a JSON object."""
    from pipewright.files import read_text

    try:
        data = json.loads(read_text(path, "--init-from file"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--init-from: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--init-from: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def read_hf_spec(folder: str | Path, *, seq_len: int | None = None, name: str = "hf") -> ModelSpec:
    """The model a Hugging Face ``config.json`` describes (``model_type`` gpt2 or llama); ``seq_len``
    defaults to the checkpoint's maximum positions."""
    from pipewright.files import naming
    from pipewright.models.checks import check_dimensions, check_weights

    cfg = _read_config(folder)
    try:
        with naming(Path(folder) / CONFIG, "--init-from config"):
            spec = _spec_from(cfg, folder, seq_len, name)
    except KeyError as exc:
        raise ConfigError(f"--init-from {folder}: {CONFIG} has no {exc.args[0]!r}") from None
    check_dimensions(spec, f"--init-from {Path(folder) / CONFIG}")
    check_weights(folder)  # headers readable before any worker loads a tensor
    return spec


def _spec_from(cfg: dict, folder: str | Path, seq_len: int | None, name: str) -> ModelSpec:
    kind = cfg.get("model_type")
    if kind == "gpt2":
        positions = cfg["n_positions"]
        if seq_len is not None and seq_len > positions:
            raise ConfigError(f"--seq-len {seq_len} exceeds the checkpoint's {positions} positions")
        h = cfg["n_embd"]
        return ModelSpec(
            name, cfg["n_layer"], h, cfg["n_head"], cfg["vocab_size"], seq_len or positions,
            ffn_hidden=cfg.get("n_inner") or 4 * h, family="gpt",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )  # fmt: skip
    if kind == "llama":
        if cfg.get("rope_scaling"):
            log.warning(
                "%s: rope_scaling %s is not applied (plain rotary embeddings)", folder, cfg["rope_scaling"]
            )
        h, a = cfg["hidden_size"], cfg["num_attention_heads"]
        return ModelSpec(
            name, cfg["num_hidden_layers"], h, a, cfg["vocab_size"],
            seq_len or cfg["max_position_embeddings"],
            ffn_hidden=cfg["intermediate_size"], family="llama", kv_heads=cfg.get("num_key_value_heads") or a,
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )  # fmt: skip
    raise ConfigError(
        f"--init-from {folder}: model_type {kind!r} is not supported; use a gpt2 or llama checkpoint"
    )


def hf_name(ours: str, family: str) -> tuple[str, bool]:
    """(Hugging Face name without prefix, transposed?) for one of our parameter names."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", ours)
    if family == "gpt":
        if m:
            i, mod, leaf = m.groups()
            theirs = _GPT2_LAYER[mod]
            return f"h.{i}.{theirs}.{leaf}", theirs in _GPT2_CONV1D and leaf == "weight"
        fixed = {
            "embed.tok.weight": "wte.weight",
            "embed.pos.weight": "wpe.weight",
            "head.out.weight": "lm_head.weight",
        }
        if ours in fixed:
            return fixed[ours], False
        return ours.replace("head.norm", "ln_f"), False
    if m:
        i, mod, leaf = m.groups()
        return f"model.layers.{i}.{_LLAMA_LAYER[mod]}.{leaf}", False
    fixed = {"embed.tok.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight"}
    return fixed.get(ours, "lm_head.weight" if ours == "head.out.weight" else ours), False


class _Reader:
    """Reads single tensors by name from a checkpoint folder (one or several safetensors files)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        folder = Path(folder)
        if (folder / INDEX).is_file():
            weight_map = _json_file(folder / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"--init-from: {folder / INDEX} has no weight_map object")
            files = sorted(set(weight_map.values()))
        elif (folder / WEIGHTS).is_file():
            files, weight_map = [WEIGHTS], None
        else:
            raise ConfigError(f"--init-from {folder}: no {WEIGHTS} or {INDEX}")
        self.handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
        self.where = weight_map or {k: WEIGHTS for k in self.handles[WEIGHTS].keys()}  # noqa: SIM118
        self.read: list[str] = []

    def find(self, name: str) -> str | None:
        for key in (name, f"transformer.{name}"):
            if key in self.where:
                return key
        return None

    def get(self, key: str) -> torch.Tensor:
        self.read.append(key)
        return self.handles[self.where[key]].get_tensor(key)


def _fallback(ours: str, family: str) -> str | None:
    """Where a tied output layer's weight is when the checkpoint has no ``lm_head``."""
    if ours != "head.out.weight":
        return None
    return "wte.weight" if family == "gpt" else "model.embed_tokens.weight"


@torch.no_grad()
def load_hf_stage_(module: nn.Module, folder: str | Path, spec: ModelSpec) -> list[str]:
    """Copy the checkpoint's tensors into ``module`` (a stage of ``spec``'s family) in place; returns
    the checkpoint keys read (only this stage's). One-line ConfigError on a missing tensor or a shape
    that does not match."""
    reader = _Reader(folder)
    family = "gpt" if spec.family in ("gpt", "bert") else spec.family
    full: dict[str, torch.Tensor] = {}
    for ours, _ in module.named_parameters():
        theirs, transpose = hf_name(ours, family)
        key = reader.find(theirs) or (
            reader.find(_fallback(ours, family)) if _fallback(ours, family) else None
        )
        if key is None:
            raise ConfigError(f"--init-from {folder}: the checkpoint has no {theirs} (for {ours})")
        tensor = reader.get(key).float()
        full[ours] = tensor.t().contiguous() if transpose else tensor
    if "embed.pos.weight" in full:
        full["embed.pos.weight"] = full["embed.pos.weight"][: spec.seq_len]
    _copy_in(module, full, folder)
    return reader.read


def _copy_in(module: nn.Module, full: dict[str, torch.Tensor], folder) -> None:
    """Write full-size tensors into ``module``'s parameters; sharded layers keep their part."""
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        own = {n: p for n, p in sub.named_parameters(recurse=False)}
        if not own:
            continue
        tensors = {n: full[dot + n] for n in own if dot + n in full}
        if not tensors:  # e.g. an output layer tied to the embedding on the same stage
            continue
        if not hasattr(sub, "load_full_"):  # a sharded layer checks the full shape itself
            for n, t in tensors.items():
                if tuple(t.shape) != tuple(own[n].shape):
                    raise ConfigError(
                        f"--init-from {folder}: {dot + n} has shape {tuple(t.shape)}, the model "
                        f"{tuple(own[n].shape)}"
                    )
        if hasattr(sub, "load_full_"):
            if "bias" in own:
                sub.load_full_(tensors["weight"], tensors.get("bias"))
            else:
                sub.load_full_(tensors["weight"])
        else:
            for n, t in tensors.items():
                own[n].copy_(t)
