"""Published training runs: the data of docs/fidelity.md.

``cost/data/published_runs.csv`` (package data; its columns are documented in its first line and in
docs/fidelity.md) holds measured runs from papers, framework documentation and vendor pages. Each row
is a :class:`Run`; :mod:`pipewright.cost.published_specs` turns it into the RunSpec of a ``pipewright
simulate`` run (shipped as ``cost/data/published_runs/<id>.toml``), filling what the source does not say
with documented defaults; here are the facts that conversion reads: for NVIDIA's recipe tables
(:data:`RECIPE_SOURCES`) sequence parallelism, tensor-parallel overlap, the distributed optimizer and
bf16 gradient buffers; the source's training framework (:data:`SOURCE_FRAMEWORK`; Megatron where not
named) and context-parallel implementation (:data:`SOURCE_CP_COMM`); :data:`OVERRIDES`, the few
per-row assumptions (each with its reason).

Throughput is compared as tokens per second per GPU: the published one is the row's
``tokens_per_s_per_gpu``, or derived from ``iteration_s`` (B·s / time / GPUs), ``samples_per_s``
(× s / GPUs), ``tflops_per_gpu`` or ``mfu`` × peak (÷ the model FLOPs per token of
:func:`flops_per_token`: Megatron-LM's count, 6 × the GEMM parameters + 12·l·s·h per token, the
recomputed forward added (× 4/3) for the sources that count it); the predicted one is B·s /
simulated iteration time / GPUs.

Pure Python: the specs are simulated by the tool and the test (``pipewright.cli.fidelity_predictions``).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from pipewright.cost import frameworks
from pipewright.cost.layer import layer_linear_flops
from pipewright.models.spec import ModelSpec

#: accelerator names in the data that are not :mod:`pipewright.hardware` presets
GPU_ALIASES = {"a100": "a100-80gb"}
#: sources whose TFLOP/s count the recomputed forward (hardware FLOPs under full recomputation)
HFU_SOURCES = ("narayanan-sc21",)
MLP_ALIASES = {"relu": "gelu", "": ""}
#: NVIDIA's Megatron-Core recipes (NeMo, Megatron-Bridge): where a row leaves them empty, sequence
#: parallelism, tensor-parallel communication overlap and the distributed optimizer are on (the
#: recipes' defaults on H100/B200), and the gradient buffers are bf16: NeMo-Framework-Launcher's
#: performance configs set ``optim.grad_sync_dtype: bf16`` (gpt3/20b_fp8_performance.yaml,
#: nemotron/nemotron_340b.yaml), NeMo 2.0's performance scripts ``grad_reduce_in_fp32 = False`` for FP8,
#: Megatron-Bridge's (25.09, 25.11) ``mixed_precision.grad_reduce_in_fp32: false`` for Llama 3 / 3.1
RECIPE_SOURCES = ("nemo-perf-summary-24.07", "nemo-perf-summary-25.02", "megatron-bridge-perf-summary")
_RECIPE_DEFAULTS = {
    "sequence_parallel": "true",
    "tp_comm_overlap": "true",
    "optimizer_sharding": "zero1",
    "grad_dtype": "bf16",
}


#: the training framework each source's runs used (``--framework``, :mod:`pipewright.cost.frameworks`);
#: a source not named here ran Megatron-LM / Megatron-Core (the default) or, for Llama 3, Meta's own
#: framework, which has no entry (priced as the default)
SOURCE_FRAMEWORK: Mapping[str, str] = {
    "torchtitan-benchmarks-2024-12": "torchtitan",
    "torchtitan-benchmarks-asynctp-2025-06": "torchtitan",
    "torchtitan-benchmarks-trainy-h200-2025-06": "torchtitan",
    "mosaicml-llm-foundry-benchmarks": "llm-foundry",
    "mt-nlg-2022": "deepspeed-megatron",
    "bigscience-bloom-tr11": "deepspeed-megatron",
}

#: the context-parallel implementation of a source whose framework has no entry (``--cp-comm``,
#: :mod:`pipewright.cost.cp_impls`): Llama 3's all-gather CP (§3.3.2); a framework's own default
#: (torchtitan: PyTorch's allgather) comes with ``--framework``
SOURCE_CP_COMM: Mapping[str, str] = {"llama3-herd-2024": "llama3-allgather"}

#: rows used to fit the calibration defaults (the rest is held out): Megatron-LM Table 1 fits the A100
#: parameters (hardware.py/transformer.py A100_EFFICIENCY); these eleven Hopper runs fit the Hopper
#: ones (GEMM efficiency 0.66, layer overhead 0.25 ms, FP8 factor 0.75: hardware._HOPPER)
MEGATRON_FIT_ROWS = frozenset(
    [f"sc21-a100-gpt-{x}" for x in ("1.7b", "3.6b", "7.5b", "18.4b", "39.1b", "76.1b", "145.6b")]
    + [f"sc21-a100-gpt-{x}" for x in ("310.1b", "529.6b", "1008.0b")]
    + [f"mlm24-h100-gpt-{x}" for x in ("1.7b", "16b", "70b", "177b", "462b")]
    + ["nemo2407-h100-gpt3-5b-64gpu", "nemo2407-h100-llama2-70b-64gpu", "nemo2407-h100-gpt3-175b-512gpu"]
    + ["nemo2407-h100-llama3-8b-8gpu", "mb2509-h100-8b-8gpu", "mb2509-h100-70b-64gpu"]
)
#: every fitted row: the Megatron calibration's and each framework's (``Framework.fitted_on``, chosen by
#: :func:`framework_fit_selection`)
FIT_ROWS = MEGATRON_FIT_ROWS | frameworks.fit_rows()

#: FlagPerf's Llama 3 script (training/benchmarks/llama3_{8B,70B}/megatron/pretrain_llama3.sh) passes no
#: ``--overlap-grad-reduce``: Megatron-LM reduces the gradients after the backward (its default)
_FLAGPERF_LLAMA3 = (
    {"grad_reduce": "after"},
    "FlagPerf's pretrain_llama3.sh passes no --overlap-grad-reduce (FlagOpen/FlagPerf@1b5a0303): "
    "Megatron-LM's default, the gradient reduction after the backward",
)

#: NVIDIA's Llama 3.1 405B recipes set Megatron-Core's ``account_for_embedding_in_pipeline_split`` and
#: ``account_for_loss_in_pipeline_split``: 126 layers + 2 over pp × v chunks, the first and last one layer
#: fewer
_EMBEDDING_AND_LOSS_SPLIT = (
    {"pipeline_split": "embedding-and-loss"},
    "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split = True in the 405B "
    "recipes the tables ran: NeMo v2.2.0 nemo/collections/llm/recipes/llama31_405b.py (25.02), "
    "Megatron-Bridge v0.1.0rc4 recipes/llama/llama31_405b.py and v0.2.0 recipes/llama/llama3.py "
    "(25.09, 25.11), not reset by their performance scripts",
)

#: per-row assumptions where the published row leaves the layout open or is inconsistent: id prefix →
#: (column values, reason)
OVERRIDES: Mapping[str, tuple[Mapping[str, str], str]] = {
    "llama3-405b-": (
        {"virtual": "8", "microbatch_size": "1", "sequence_parallel": "true"},
        "Llama 3 §3.3.2: interleaved stages, the first and last chunk holding the embedding or the "
        "output layer alone (126 layers + 2 = 8 chunks × 16 ranks); microbatch 1 and sequence "
        "parallelism with TP 8 assumed",
    ),
    "tt24-405b-512gpu-t5-interleaved-1f1b": (
        {"virtual": "2"},
        "torchtitan's default for a multi-stage schedule without split points: 2 stages per rank "
        "(generate_split_points in its pipeline code at the benchmarked commit)",
    ),
    "nemo2502-b200-llama3-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "mb2509-h100-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "mb2509-b200-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "mb2511-h100-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "mb2511-b200-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "mb260401-h100-405b-": _EMBEDDING_AND_LOSS_SPLIT,
    "flagperf-a800-llama3-": _FLAGPERF_LLAMA3,
    "flagperf-h100-llama3-": _FLAGPERF_LLAMA3,
    "megascale-a100-": (
        {"grad_reduce": "after"},
        "MegaScale's Table 3 adds 'DP overlap' (the distributed optimizer's reduce-scatter and all-gather "
        "overlapped, §3.2) over its Megatron-LM baseline, which therefore reduced after the pipeline",
    ),
    "korthikanti-a100-22b-": (
        {"gpus": "8"},
        "the row gives 4 GPUs with tensor parallelism 8; Korthikanti et al. run 22B on 8 GPUs (t = 8)",
    ),
}


@dataclass(frozen=True)
class Run:
    """One published run (a row of the CSV, as strings)."""

    row: Mapping[str, str]

    def __getitem__(self, key: str) -> str:
        for prefix, (values, _) in OVERRIDES.items():
            if self.row.get("id", "").startswith(prefix) and key in values:
                return values[key]
        value = self.row.get(key, "") or ""
        if not value and self.row.get("source") in RECIPE_SOURCES:
            return _RECIPE_DEFAULTS.get(key, "")
        return value

    def int(self, key: str, default: int = 0) -> int:
        value = self[key]
        return int(float(value)) if value else default

    def float(self, key: str) -> float | None:
        value = self[key]
        return float(value) if value else None

    @property
    def id(self) -> str:
        return self["id"]

    @property
    def gpus(self) -> int:
        return self.int("gpus")

    @property
    def seq(self) -> int:
        return self.int("seq_len")

    def spec(self) -> ModelSpec:
        """The row's model (family llama where it has grouped-query attention or the llama family)."""
        llama = self["family"] == "llama" or self.int("kv_heads") not in (0, self.int("heads"))
        mlp = MLP_ALIASES.get(self["mlp"], self["mlp"]) or ("swiglu" if llama else "gelu")
        return ModelSpec(
            self.id,
            self.int("layers"),
            self.int("hidden"),
            self.int("heads"),
            self.int("vocab", DEFAULT_VOCAB),
            self.seq,
            ffn_hidden=self.int("ffn_hidden"),
            family="llama" if llama else "gpt",
            kv_heads=self.int("kv_heads"),
            mlp=mlp,
        )


#: vocabulary where a source does not give it (Zero Bubble: "size not stated")
DEFAULT_VOCAB = 50257


def framework_of(run: Run) -> str:
    """The framework ``run`` was trained with (:data:`SOURCE_FRAMEWORK`; default megatron)."""
    return SOURCE_FRAMEWORK.get(run["source"], frameworks.DEFAULT_FRAMEWORK)


def mispriced_mechanism(run: Run) -> str:
    """Why a run's time is known to be mispriced by a mechanism no input describes ("" when none):
    torchtitan's asynchronous TP (priced per collective as the micro-pipeline pass fuses it, a reading
    of the pass's code no measurement checks; docs/fidelity.md), and context parallelism at cp ≥ 4, where
    the torchtitan rows stay 48–77 % above what PyTorch's ``context_parallel`` code executes
    (``--cp-comm torch-allgather``; its head-tail split is balanced) for a reason no source states. Such
    rows are never fit rows."""
    async_tp = frameworks.framework(framework_of(run)).tp_overlap == "async-tp"
    if async_tp and run["tp_comm_overlap"] == "true" and run.int("tp", 1) > 1:
        return "asynchronous TP"
    if run.int("cp", 1) >= 4:
        return "cp ≥ 4"
    return ""


def framework_fit_selection(runs: tuple[Run, ...], name: str) -> tuple[str, ...]:
    """The rows a framework's calibration is fitted on, by a fixed rule: the framework's runs without a
    :func:`mispriced_mechanism`, within each source sorted by id, every second one (the 2nd, 4th, …), so
    at most half of each source's rows."""
    picked: list[str] = []
    for source in sorted({r["source"] for r in runs if framework_of(r) == name}):
        ids = sorted(r.id for r in runs if r["source"] == source and not mispriced_mechanism(r))
        picked += ids[1::2]
    return tuple(sorted(picked))


def load_runs() -> tuple[Run, ...]:
    """The published runs shipped with the package."""
    text = resources.files("pipewright.cost").joinpath("data/published_runs.csv").read_text()
    return tuple(Run(r) for r in csv.DictReader(text.splitlines()))


def flops_per_token(run: Run) -> float:
    """Model FLOPs per token (Megatron-LM's count): 3 × (forward GEMMs + 4·s·h attention per layer +
    2·h·V logits), × 4/3 for sources that add the recomputed forward (:data:`HFU_SOURCES`)."""
    spec = run.spec()
    forward = spec.layers * (layer_linear_flops(spec, 1) / spec.seq_len + 4 * spec.seq_len * spec.hidden)
    total = 3 * (forward + 2 * spec.hidden * spec.vocab)
    if run["source"] in HFU_SOURCES and run["recompute"] == "full":
        total += forward
    return total


def published_tokens_per_s(run: Run, peak: float | None = None) -> float | None:
    """Published tokens/s per GPU (module docstring); None when the row has no throughput."""
    if run.float("tokens_per_s_per_gpu"):
        return run.float("tokens_per_s_per_gpu")
    gbs = run.int("global_batch_size")
    if run.float("iteration_s") and gbs:
        return gbs * run.seq / run.float("iteration_s") / run.gpus
    if run.float("samples_per_s"):
        return run.float("samples_per_s") * run.seq / run.gpus
    tflops = run.float("tflops_per_gpu")
    if tflops is None and run.float("mfu") and peak:
        tflops = run.float("mfu") * peak / 1e12
    return None if tflops is None else tflops * 1e12 / flops_per_token(run)
