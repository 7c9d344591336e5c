"""Each published run as a RunSpec: the run specs shipped in ``cost/data/published_runs/<id>.toml``.

:func:`run_facts` is the one conversion from a row of ``published_runs.csv``
(:class:`~pipewright.cost.fidelity.Run`, its published facts and the assumptions of
:data:`~pipewright.cost.fidelity.OVERRIDES`) to the values of a ``pipewright simulate`` run, by spec
path (docs/run-spec.md). What the source does not say gets a documented default: microbatch size 1;
the 1F1B schedule (interleaved where the row gives v > 1; plain 1F1B with one stage or FSDP alone); no
recomputation; bf16; flash attention with the GPU's usual kernel (the row's ``attention_kernel`` where
the source names it); 8 GPUs per node; the gradient reduction overlapped with the backward for runs from
2023 on, after the pipeline drains before; the source's training framework
(:data:`~pipewright.cost.fidelity.SOURCE_FRAMEWORK`; Megatron where not named) and, without a framework
entry, its context-parallel implementation (:data:`~pipewright.cost.fidelity.SOURCE_CP_COMM`); Zero
Bubble's, Llama 3's and the embedding-and-loss split's layouts (:func:`layout_for`); Zero Bubble's
zero-bubble runs simulated over three iterations without the optimizer's barrier (post-validation, §4).

:func:`spec_text` writes a row's spec file: the facts alone (a key left out is ``simulate``'s default),
under a header naming the row, its source and its assumptions; :func:`published_spec` reads a shipped
file. ``tools/fidelity.py --write-specs`` writes them all; tests/test_fidelity.py checks that the
package's files are what :func:`spec_text` makes of the CSV. Pure Python.
"""

from __future__ import annotations

import textwrap
from importlib import resources
from importlib.abc import Traversable
from typing import Any

from pipewright.cost import frameworks
from pipewright.cost.fidelity import GPU_ALIASES, OVERRIDES, SOURCE_CP_COMM, Run, framework_of
from pipewright.models.layout import parse_layout
from pipewright.runspec import RunSpec, defaults, dump_toml, loads_toml, validate, values, with_values

#: the command every published spec describes a run of
COMMAND = "simulate"
#: the package folder of the spec files (one ``<id>.toml`` per row)
SPEC_DIR = "data/published_runs"

Path = tuple[str, ...]


def layout_for(run: Run, stages: int) -> str | None:
    """Zero Bubble's and Llama 3's layouts, and Megatron-Core's split that counts the embedding and the
    loss as a layer each (``pipeline_split`` "embedding-and-loss"): layers = k·stages − 2, the first and
    last stage one layer fewer (Llama 3: one layer per chunk, so the embedding and the output layer
    alone). Written in Megatron-Core's layout language with its repetition (``E|(t|)*126L``)."""
    edges = run["source"] in ("zero-bubble-iclr2024", "llama3-herd-2024")
    if not (edges or run["pipeline_split"] == "embedding-and-loss") or stages < 2:
        return None
    k = (run.int("layers") + 2) // stages
    mid = [f"t*{k}"] * (stages - 2)
    edge = f"t*{k - 1}" if k > 2 else "t" if k == 2 else ""
    return parse_layout("|".join([f"E{edge}", *mid, f"{edge}L"])).compact()


def _schedule(run: Run, pp: int, v: int) -> tuple[str, int]:
    """The row's schedule and virtual stages per rank: one stage or FSDP alone is 1F1B without virtual
    stages; 1F1B with v > 1 is interleaved, interleaved with v = 1 plain 1F1B."""
    schedule = run["schedule"] or "1f1b"
    if schedule == "fsdp-only" or pp == 1:
        return "1f1b", 1
    if schedule == "interleaved-1f1b" and v == 1:
        return "1f1b", v
    if schedule == "1f1b" and v > 1:
        return "interleaved-1f1b", v
    return schedule, v


def run_facts(run: Run) -> dict[Path, Any]:
    """The ``simulate`` run of a published row, as values by spec path (module docstring)."""
    model = run.spec()
    gpus = run.gpus
    per_node = min(run.int("gpus_per_node", 8), gpus)
    tp, pp, cp, dp = (run.int(k, 1) for k in ("tp", "pp", "cp", "dp"))
    schedule, v = _schedule(run, pp, run.int("virtual", 1))
    facts: dict[Path, Any] = {
        ("model", "model"): model.family,
        ("model", "layers"): model.layers,
        ("model", "hidden"): model.hidden,
        ("model", "heads"): model.heads,
        ("model", "vocab"): model.vocab,
        ("model", "seq_len"): model.seq_len,
        ("model", "ffn_hidden"): model.ffn_hidden,
        ("model", "mlp"): model.mlp,
        ("cluster", "gpu"): GPU_ALIASES.get(run["gpu"], run["gpu"]),
        ("cluster", "nodes"): max(1, gpus // per_node),
        ("cluster", "gpus_per_node"): per_node,
        ("parallelism", "tp"): tp,
        ("parallelism", "pp"): pp,
        ("parallelism", "dp"): dp,
        ("schedule", "name"): schedule,
        ("batch", "microbatch_size"): run.int("microbatch_size", 1),
        ("batch", "global_batch_size"): run.int("global_batch_size"),
        ("memory", "recompute"): run["recompute"] or "none",
        ("precision", "dtype"): run["dtype"] or "bf16",
        ("framework", "attention"): run["attention"] or "flash",
    }
    if model.family == "llama":
        facts["model", "kv_heads"] = model.kv_heads
    if cp > 1:
        facts["parallelism", "cp"] = cp
        if run["source"] in SOURCE_CP_COMM:
            facts["framework", "cp_comm"] = SOURCE_CP_COMM[run["source"]]
    if v > 1:
        facts["parallelism", "virtual"] = v
    if run["sequence_parallel"] == "true" and tp > 1:
        facts["parallelism", "sequence_parallel"] = True
    sharding = {"zero1": ("memory", "shard_optimizer"), "fsdp": ("memory", "fsdp")}
    if run["optimizer_sharding"] in sharding:
        facts[sharding[run["optimizer_sharding"]]] = True
    columns = {
        "grad_dtype": ("framework", "grad_dtype"),
        "kernels": ("framework", "kernels"),
        "fsdp_grad_sync": ("memory", "fsdp_grad_sync"),
        "attention_kernel": ("framework", "attention_kernel"),
    }
    facts.update({path: run[column] for column, path in columns.items() if run[column]})
    if framework_of(run) != frameworks.DEFAULT_FRAMEWORK:
        facts["framework", "name"] = framework_of(run)
    if run["tp_comm_overlap"] == "true" and tp > 1:  # the framework's own (cost/frameworks.py)
        facts["framework", "tp_comm_overlap"] = True
    if dp * cp > 1:
        year_default = "overlap" if run.int("year") >= 2023 else "after"
        facts["framework", "grad_reduce"] = run["grad_reduce"] or year_default
    layout = layout_for(run, pp * v)
    if layout:
        facts["parallelism", "layout"] = layout
    if run["source"] == "zero-bubble-iclr2024" and schedule.startswith("zb"):
        # the paper's zero-bubble runs replace the optimizer's synchronisation by post-validation (§4):
        # consecutive iterations overlap, so the steady period of three is what they measure
        facts["simulation", "iterations"] = 3
        facts["simulation", "no_step_barrier"] = True
    return facts


def run_spec(run: Run) -> RunSpec:
    """The RunSpec of a published row: ``simulate``'s defaults with :func:`run_facts` set; checked."""
    return validate(with_values(defaults(COMMAND), run_facts(run)), source=run.id)


def _assumptions(run: Run) -> list[str]:
    return [reason for prefix, (_, reason) in OVERRIDES.items() if run.id.startswith(prefix)]


def spec_text(run: Run) -> str:
    """The spec file of a published row: a comment header, then :func:`run_facts` as TOML tables in the
    spec's declaration order (every other key is ``simulate``'s default)."""
    spec = run_spec(run)
    everything = values(spec)
    facts = {path: everything[path] for path in run_facts(run)}
    # dump_toml leaves None out: every value None but the facts writes the facts alone
    body = dump_toml(with_values(spec, dict.fromkeys(everything) | facts))
    header = [
        f"# {run.id}: {run['model']}, {run.gpus} × {run['gpu']} ({run['source']}, {run['year']})",
        "# A RunSpec (docs/run-spec.md) of the run as docs/fidelity.md simulates it; a key left out is",
        "# `simulate`'s default. The published numbers, the source and what was assumed are its row of",
        "# src/pipewright/cost/data/published_runs.csv, from which `tools/fidelity.py --write-specs`",
        "# writes this file.",
        *(
            textwrap.fill(f"Assumed: {reason}", 108, initial_indent="# ", subsequent_indent="#   ")
            for reason in _assumptions(run)
        ),
    ]
    return "\n".join(header) + "\n\n" + body


def spec_name(run_id: str) -> str:
    """The file name of a row's spec."""
    return f"{run_id}.toml"


def spec_files() -> Traversable:
    """The package folder of the published specs."""
    return resources.files("pipewright.cost").joinpath(SPEC_DIR)


def spec_texts(runs: tuple[Run, ...]) -> dict[str, str]:
    """The spec file of each run by file name (what ``tools/fidelity.py --write-specs`` writes)."""
    return {spec_name(run.id): spec_text(run) for run in runs}


def published_spec(run_id: str) -> RunSpec:
    """The shipped spec of the published run ``run_id`` (read as ``simulate`` reads a file)."""
    text = spec_files().joinpath(spec_name(run_id)).read_text(encoding="utf-8")
    return loads_toml(text, COMMAND, source=f"{SPEC_DIR}/{spec_name(run_id)}")
