"""A checkpoint's identity: the fingerprint of the model's dimensions, tokenizer and tensor-parallel
state layout that a run must match to resume it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from pipewright.models.presets import MOE_FIELDS
from pipewright.models.spec import ModelSpec


def fingerprint(spec: ModelSpec, tokenizer: str, tp: int = 1) -> str:
    """What a checkpoint must match to be resumed: the model's dimensions, the tokenizer and, when
    tp > 1, the tensor-parallel state layout (the token embedding is then vocabulary-parallel, so
    ``embed.tok.weight`` is stored as per-rank shards). tp = 1 fingerprints are those of a run without
    tensor parallelism. Sequence parallelism and scatter/gather change no state: not recorded."""
    dims = asdict(spec)
    dims.pop("name")
    if spec.family != "llama":  # Llama-only fields: keep older GPT fingerprints unchanged
        dims.pop("kv_heads")
        dims.pop("rope_theta")
    # dense: fingerprints as before the mixture-of-experts fields; the loss weights change no state
    for name in MOE_FIELDS if not spec.is_moe else ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        dims.pop(name)
    # the cost model's only: the runtime builds neither MLA nor MTP, and prices no activation set
    for name in ("attention_kind", "mtp_depth", "layer_activations"):
        dims.pop(name)
    record: dict = {"model": dims, "tokenizer": tokenizer}
    if tp > 1:
        record["tensor_parallel"] = {"tp": tp, "embedding": "vocab-parallel"}
    text = json.dumps(record, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
