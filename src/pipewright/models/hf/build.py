"""Read a Hugging Face model (``config.json``, weights when ``model.safetensors`` is there) and build
pipeline stages from it with the ``transformers`` library itself.

``--hf-model`` takes a folder holding ``config.json`` or the path of a config file. The model is made
by ``AutoModelForCausalLM`` — from the weights (``model.safetensors`` or a sharded index) when the
folder has them, else randomly initialised by the model's own ``_init_weights`` under
``torch.manual_seed(seed)`` — in fp32, then cut: a stage keeps its own modules of the model and the
rest is freed (a stage holding both embedding and output layer keeps a tied table as one tensor). The
whole model is built for every stage, so the initial weights do not depend on the layout; the peak
host memory of building is one fp32 copy of the model.

The :class:`~pipewright.models.spec.ModelSpec` of such a model has family "hf" and the source as its
``name``: the stage builder registered for "hf" (``models/family.py``) reads the model from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.hf.adapters import Adapter, adapter_for, modules
from pipewright.models.hf.linears import (
    defers_in_place,
    keeps_layers,
    make_deferrable_,
    rebuild_linears_,
    rebuilt,
    share_inputs_,
)
from pipewright.models.hf.router_loss import router_loss_of
from pipewright.models.hf.stage import HFEmbed, HFHead, HFStage
from pipewright.models.layout import Layout, resolve_stage
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import LinearFactory, default_linear_factory

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf-model needs the transformers library; pip install 'pipewright[hf]'") from None
    return transformers


def config_file(source: str | Path) -> Path:
    """``source``'s config.json (``source`` is the folder or the file); one-line error when missing."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"--hf-model {source}: no config.json; give a Hugging Face model folder or its config"
        )
    return file


def load_config(source: str | Path):
    """The ``transformers`` config of ``source``; attention as ``attn_implementation`` in the file says
    (eager, sdpa, …), else the library's default for the family."""
    from pipewright.files import read_text
    from pipewright.outputs import shown

    file = config_file(source)
    try:
        data = json.loads(read_text(file, "--hf-model config"))  # one line for a binary file too
    except ValueError as exc:
        raise ConfigError(f"--hf-model {source}: {file.name} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--hf-model {source}: {file.name} holds a JSON {type(data).__name__}, not an object"
        )
    transformers = _transformers()
    model_type = data.pop("model_type", None)
    attn = data.pop("attn_implementation", None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # the library's validation errors have no common base below Exception
        raise ConfigError(
            f"--hf-model {source}: model_type {shown(model_type, 40)} is not a transformers "
            f"{transformers.__version__} model ({shown(str(exc).splitlines()[0], 160)})"
        ) from None
    if attn is not None:
        config._attn_implementation = attn
    return config


def read_spec(source: str | Path, *, seq_len: int | None = None) -> ModelSpec:
    """The dimensions of ``source``'s model as a ModelSpec (family "hf", ``name`` = the source)."""
    from pipewright.files import naming
    from pipewright.models.checks import check_dimensions, check_weights

    config = load_config(source)
    with naming(config_file(source), "--hf-model config"):
        spec = _spec(config, source, seq_len)
    check_dimensions(spec, f"--hf-model {config_file(source)}")
    check_weights(config_file(source).parent)  # headers readable: a damaged file fails here, not in a worker
    return spec


def _spec(config, source: str | Path, seq_len: int | None) -> ModelSpec:
    h, a = config.hidden_size, config.num_attention_heads
    positions = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and positions and seq_len > positions and adapter_for(config.model_type).positions:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's {positions} learned positions")
    given = (getattr(config, "intermediate_size", None), getattr(config, "n_inner", None))
    ffn = next((x for x in given if x is not None), 4 * h)
    if not isinstance(ffn, int) or ffn < 1:  # ModelSpec reads 0 as "4 h": a 0 in the file is refused
        raise ConfigError(f"intermediate_size must be a positive integer (got {ffn!r:.40})")
    return ModelSpec(
        name=str(source),
        layers=config.num_hidden_layers,
        hidden=h,
        heads=a,
        vocab=config.vocab_size,
        seq_len=seq_len or min(positions or 2048, 2048),
        ffn_hidden=ffn,
        family="hf",
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        kv_heads=getattr(config, "num_key_value_heads", None) or a,
        mlp="gelu" if adapter_for(config.model_type).rotary is None else "swiglu",
        layer_activations=adapter_for(config.model_type).layer_activations(
            getattr(config, "_attn_implementation", None)
        ),
    )


def full_model(source: str, seed: int) -> nn.Module:
    """The whole ``transformers`` model of ``source`` in fp32: its weights, or initialised from ``seed``."""
    transformers = _transformers()
    config = load_config(source)
    folder = config_file(source).parent
    auto = transformers.AutoModelForCausalLM
    if os.environ.get("RANK", "0") != "0":  # one loading bar per run (rank 0's), not one per process
        transformers.utils.logging.disable_progress_bar()
    if any((folder / f).is_file() for f in WEIGHT_FILES):
        model = auto.from_pretrained(folder, config=config, dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=torch.float32)
    return model.train()


def build_stage(
    spec: ModelSpec,
    layout: Layout | str | None,
    stage_index: int,
    *,
    seed: int = 0,
    num_stages: int | None = None,
    linear_factory: LinearFactory | None = None,
) -> HFStage:
    """Stage ``stage_index`` of the Hugging Face model ``spec.name`` (signature of
    :func:`pipewright.models.gpt.build_stage`)."""
    return stage_from_model(full_model(spec.name, seed), layout, stage_index, num_stages, linear_factory)


def stage_from_model(
    model: nn.Module,
    layout: Layout | str | None,
    stage_index: int,
    num_stages: int | None = None,
    linear_factory: LinearFactory | None = None,
) -> HFStage:
    """Stage ``stage_index`` cut from the ``transformers`` model ``model`` (its own modules)."""
    config = model.config
    stage = resolve_stage(layout, config.num_hidden_layers, stage_index, num_stages)
    found = modules(model, config.model_type)
    adapter = adapter_for(config.model_type)
    make = linear_factory or default_linear_factory
    if not (keeps_layers(make) or defers_in_place(make)):
        _check_tp(config, adapter, make)
    wanted = nn.ModuleDict()
    if stage.embedding:
        wanted["tok"] = found["embedding"]
        if "position embedding" in found:
            wanted["pos"] = found["position embedding"]
    for i in stage.layers:
        wanted[f"layer{i}"] = found["decoder layers"][i]
    if stage.head:
        wanted["norm"], wanted["out"] = found["final norm"], found["output layer"]
    if stage.layers and "rotary embedding" in found:
        wanted["rotary"] = found["rotary embedding"]
    part = wanted  # the model's own modules (a table tied inside the stage stays one tensor)
    scale = None
    if defers_in_place(make):
        make_deferrable_(part)
    elif not keeps_layers(make):
        scale = _tensor_parallel_(part, make, adapter, config.model_type, stage.layers)
    embed = HFEmbed(part["tok"], getattr(part, "pos", None), scale) if stage.embedding else None
    head = (
        HFHead(part["norm"], part["out"], getattr(config, "final_logit_softcapping", None))
        if stage.head
        else None
    )
    layers = {i: part[f"layer{i}"] for i in stage.layers}
    rotary = getattr(part, "rotary", None)
    return HFStage(config, embed, layers, head, rotary, adapter.rotary_per_type, router_loss_of(model))


def _check_tp(config, adapter: Adapter, make: LinearFactory) -> None:
    if not adapter.tp_kinds:
        raise ConfigError(
            f"tensor parallelism: model_type {config.model_type!r} cannot be split ({adapter.tp_blocker}); "
            "use --tp 1"
        )
    if getattr(make, "sequence_parallel", False):
        raise ConfigError("--sequence-parallel is not supported for --hf-model; drop it")
    tp = getattr(make, "tp", 1)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv % tp:
        raise ConfigError(f"key/value heads ({kv}) are not divisible by --tp {tp}; choose t dividing it")


def _tensor_parallel_(part: nn.ModuleDict, make: LinearFactory, adapter: Adapter, model_type: str, layers):
    """Rebuild the stage's linear layers and token embedding with the tensor-parallel factory ``make``;
    returns the embedding's scale (Gemma) when the table was rebuilt."""
    for i in layers:
        rebuild_linears_(part[f"layer{i}"], make, dict(adapter.tp_kinds), f"layers.{i}", model_type)
        share_inputs_(part[f"layer{i}"])
        _sum_head_params_over_tp(part[f"layer{i}"], getattr(make, "group", None))
    if "out" in part:
        part["out"] = rebuilt(part["out"], make, "output")
    scale = None
    if "tok" in part and hasattr(make, "embedding"):
        tok = part["tok"]
        scale = getattr(tok, "embed_scale", None)
        new = make.embedding(tok.num_embeddings, tok.embedding_dim)
        with torch.no_grad():
            new.load_full_(tok.weight)
        _keep_padding_row(new, tok.padding_idx)
        part["tok"] = new
    return None if scale is None else scale.detach().clone()


def _keep_padding_row(table: nn.Module, padding_idx: int | None) -> None:
    """``nn.Embedding(padding_idx=p)`` never updates row p: zero its gradient in the shard that holds it
    (a vocabulary-parallel table keeps rows [vocab_start, vocab_start + per_rank))."""
    if padding_idx is None:
        return
    start = getattr(table, "vocab_start", 0)
    local = padding_idx - start
    if 0 <= local < table.weight.shape[0]:
        table.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([local], device=g.device), 0.0))


def _sum_head_params_over_tp(layer: nn.Module, group) -> None:
    """Parameters inside the attention besides its projections (Qwen3's and Gemma 3's per-head q_norm and
    k_norm) are replicated but see only this rank's heads: their gradient is summed over the
    tensor-parallel group as it is computed (all tp ranks run the same backward in step)."""
    import torch.distributed as dist

    if group is None:
        return
    for module in layer.modules():
        if not hasattr(module, "q_proj"):
            continue
        own = {
            id(p)
            for child in ("q_proj", "k_proj", "v_proj", "o_proj")
            for p in module.get_submodule(child).parameters()
        }
        for param in module.parameters():
            if id(param) not in own:
                param.register_hook(lambda g: _all_reduced(g, group, dist))


def _all_reduced(grad: torch.Tensor, group, dist) -> torch.Tensor:
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total
