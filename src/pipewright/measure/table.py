"""The full-size table of docs/fidelity.md's "The real program against the simulator" section: real
model sizes and layouts, one pipeline rank each measured (:func:`pipewright.measure.measure_run`) next
to the simulator. ``tools/measure_table.py`` measures every row and writes the package data
(``data/measured_ranks.json``) and the Markdown; tests check the page and the simulated side against it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

#: the Llama 3 405B layout: the embedding and the output layer alone on the first and last of 128 stages
LAYOUT_405B = "E|" + "|".join(["t"] * 126) + "|L"

_LLAMA = {"microbatch_size": 1, "precision": "bf16", "progress": False}
_L8 = {**_LLAMA, "model": "llama3-8b", "vocab": 128256, "tp": 1, "pp": 4, "microbatches": 8}
_L70 = {**_LLAMA, "model": "llama3-70b", "vocab": 128256, "tp": 8, "pp": 4, "microbatches": 8}
_L70 |= {"sequence_parallel": True}
_G175 = {**_LLAMA, "model": "gpt3-175b", "vocab": 51200, "tp": 8, "pp": 16, "microbatches": 16}
_G175 |= {"sequence_parallel": True}
_MIXTRAL = {**_LLAMA, "model": "mixtral-8x7b", "vocab": 32000, "tp": 1, "pp": 4, "dp": 8, "ep": 8}
_MIXTRAL |= {"microbatches": 8}
#: Llama 3 8B's config.json (its published dimensions) for transformers' LlamaForCausalLM
HF_CONFIG = Path(__file__).resolve().parent / "data" / "hf-llama3-8b-config.json"

#: (row name, TrainConfig fields, pipeline rank measured)
ROWS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("llama3-8b t1 p4 1f1b", {**_L8, "schedule": "1f1b"}, 0),
    ("llama3-8b t1 p4 1f1b, last rank", {**_L8, "schedule": "1f1b"}, 3),
    ("llama3-8b t1 p4 1f1b recompute selective", {**_L8, "schedule": "1f1b", "recompute": "selective"}, 0),
    ("llama3-8b t1 p4 1f1b recompute full", {**_L8, "schedule": "1f1b", "recompute": "full"}, 0),
    ("llama3-8b t1 p4 d4 1f1b ZeRO-1", {**_L8, "schedule": "1f1b", "dp": 4, "shard_optimizer": True}, 0),
    ("llama3-8b t1 p4 c2 1f1b", {**_L8, "schedule": "1f1b", "cp": 2}, 0),
    ("llama3-8b t1 p4 zb-h1", {**_L8, "schedule": "zb-h1"}, 0),
    ("llama3-8b t1 p4 zb-h2", {**_L8, "schedule": "zb-h2"}, 0),
    ("llama3-8b t1 p4 zb-auto", {**_L8, "schedule": "zb-auto"}, 0),
    ("llama3-8b t1 p4 v-half", {**_L8, "schedule": "v-half"}, 0),
    ("llama3-8b t1 p4 v-min", {**_L8, "schedule": "v-min"}, 0),
    ("llama3-8b t1 p4 c4 1f1b", {**_L8, "schedule": "1f1b", "cp": 4}, 0),
    ("llama3-8b t1 p4 c8 1f1b", {**_L8, "schedule": "1f1b", "cp": 8}, 0),
    (
        "llama3-8b t1 p4 1f1b tied embeddings, last rank",
        {**_L8, "schedule": "1f1b", "tie_embeddings": True},
        3,
    ),
    (  # vocabulary parallelism trains in fp32
        "gpt3-6.7b t1 p4 1f1b vocabulary parallel alg1 fp32",
        {**_LLAMA, "model": "gpt3-6.7b", "vocab": 51200, "tp": 1, "pp": 4, "microbatches": 8}
        | {"schedule": "1f1b", "precision": "fp32", "vocab_parallel": "alg1"},
        0,
    ),
    ("llama3-8b t1 p4 1f1b K-FAC", {**_L8, "schedule": "1f1b", "optimizer": "kfac"}, 0),
    (  # asynchronous schedules train in fp32 (PipeDream's weight stashing)
        "llama3-8b t1 p4 async-1f1b stash fp32",
        {**_L8, "schedule": "async-1f1b", "precision": "fp32", "weight_policy": "stash"},
        0,
    ),
    (
        "llama3-8b t1 p4 async-zb-h1 stash fp32",
        {**_L8, "schedule": "async-zb-h1", "precision": "fp32", "weight_policy": "stash"},
        0,
    ),
    (  # Mixtral 8x7B: one expert a rank (ep 8 over dp 8), sequence 4096
        "mixtral-8x7b t1 p4 d8 e8 1f1b",
        {**_LLAMA, "model": "mixtral-8x7b", "vocab": 32000, "tp": 1, "pp": 4, "dp": 8, "ep": 8}
        | {"microbatches": 8, "schedule": "1f1b"},
        0,
    ),
    (  # a DeepSeek-style MoE: DeepSeek-V3 (MLA, 256 experts, top 8, 1 shared), 32 experts a rank
        "deepseek-v3 t1 p16 d8 e8 1f1b",
        {**_LLAMA, "model": "deepseek-v3", "vocab": 129280, "tp": 1, "pp": 16, "dp": 8, "ep": 8}
        | {"microbatches": 16, "schedule": "1f1b"},
        1,
    ),
    (  # what `plan` picks for 8 H100s and a global batch of 64 (docs/fidelity.md's example)
        "llama3-8b t1 p2 d4 interleaved v4 ZeRO-1",
        {**_L8, "pp": 2, "dp": 4, "shard_optimizer": True, "microbatches": 16}
        | {"schedule": "interleaved-1f1b", "virtual": 4},
        0,
    ),
    ("llama3-70b t8 p4 sp interleaved v2", {**_L70, "schedule": "interleaved-1f1b", "virtual": 2}, 0),
    ("llama3-70b t8 p4 sp zbv", {**_L70, "schedule": "zbv"}, 0),
    ("llama3-70b t8 p4 sp dualpipev", {**_L70, "schedule": "dualpipev"}, 0),
    (
        "llama3-405b t8 p16 v8 sp interleaved",
        {
            **_LLAMA,
            "model": "llama3-405b",
            "vocab": 128256,
            "tp": 8,
            "pp": 16,
            "virtual": 8,
            "layout": LAYOUT_405B,
            "schedule": "interleaved-1f1b",
            "microbatches": 16,
            "sequence_parallel": True,
        },
        0,
    ),
    ("gpt3-175b t8 p16 sp 1f1b", {**_G175, "schedule": "1f1b"}, 0),
    ("gpt3-175b t8 p16 sp zb-h1", {**_G175, "schedule": "zb-h1"}, 0),
    ("gpt3-175b t8 p16 sp zbv", {**_G175, "schedule": "zbv"}, 0),
    ("mixtral-8x7b t1 p4 d8 e8 dualpipev", {**_MIXTRAL, "schedule": "dualpipev"}, 0),
    (  # the Hugging Face path: transformers' own Llama layers, built from a config.json
        "hf llama3-8b (transformers) t1 p4 1f1b",
        {**_LLAMA, "hf_model": str(HF_CONFIG), "seq_len": 8192, "tp": 1, "pp": 4, "microbatches": 8}
        | {"schedule": "1f1b"},
        0,
    ),
)

DATA = "measured_ranks.json"


def load() -> list[dict[str, Any]]:
    """The recorded rows (package data)."""
    return json.loads(resources.files("pipewright.measure").joinpath("data", DATA).read_text())


def record(name: str, fields: dict[str, Any], cmp) -> dict[str, Any]:
    """One row of the package data from a :class:`~pipewright.measure.side_by_side.RankComparison`
    (a config file named by its place in the package)."""
    shown = {
        k: f"pipewright/measure/data/{Path(v).name}" if k == "hf_model" else v for k, v in fields.items()
    }
    return {"name": name, "config": shown, **cmp.as_dict()}


def _pair(rows: dict[str, Any], name: str) -> tuple[float, float]:
    return rows[name]["measured"], rows[name]["simulated"]


def _cell(meas: float, sim: float, unit: float, digits: int) -> str:
    diff = sim / meas - 1 if meas else 0.0
    return f"{meas / unit:.{digits}f} / {sim / unit:.{digits}f} ({diff:+.1%})"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The section's table: per row measured / simulated peak memory, activations part, F and B (or I)
    FLOPs, boundary message, the tensor-, context- and expert-parallel collectives' bytes where a row
    has them, and where the measured peak falls."""
    head = (
        "| row | pp rank | peak GiB meas. / sim. | activations GiB | static GiB | F TFLOP | B+I+W TFLOP "
        "| message MiB | tp / cp / ep GB | measured peak at |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for row in rows:
        r = row["rows"]
        back = [_pair(r, k) for k in ("FLOPs B", "FLOPs I", "FLOPs W") if k in r]
        back_m, back_s = sum(a for a, _ in back), sum(b for _, b in back)
        msg = _pair(r, "boundary message") if "boundary message" in r else (0.0, 0.0)
        lines.append(
            f"| {row['name']} | {row['pp_rank']} | {_cell(*_pair(r, 'peak memory'), 2**30, 1)} "
            f"| {_cell(*_pair(r, '  activations'), 2**30, 1)} | {_cell(*_pair(r, '  static'), 2**30, 1)} "
            f"| {_cell(*_pair(r, 'FLOPs F'), 1e12, 1)} | {_cell(back_m, back_s, 1e12, 1)} "
            f"| {msg[0] / 2**20:.1f} / {msg[1] / 2**20:.1f} | {_collectives(r)} | {row['peak_action']} |"
        )
    return "\n".join(lines)


def _collectives(rows: dict[str, Any]) -> str:
    """``tp 410.2 / 173.9 (-57.6%)``-style cells of the tp, cp and ep bytes a row has; — if none."""
    cells = [
        f"{group} {_cell(*_pair(rows, f'{group} bytes'), 1e9, 1)}"
        for group in ("tp", "cp", "ep")
        if f"{group} bytes" in rows
    ]
    return "; ".join(cells) or "—"
