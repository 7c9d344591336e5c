"""TrainConfig: everything ``pipewright train`` needs, from flags and/or a TOML file, checked before any
worker starts.

The core fields are the trainer's own settings and its *training options* (recomputation, precision,
ZeRO-1, tied embeddings, ``--init-from``). The options of *features* (the bundles of
:mod:`pipewright.features`) are not fields: they are kept in :attr:`TrainConfig.features` under their
flat names (``toy_level``, from ``--toy-level``; see :mod:`pipewright.options`), read back as
attributes (``config.toy_level``), and checked and given their defaults by the composition root
(:func:`pipewright.training.check_config`), which knows the registered features."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.models.presets import MOE_FIELDS, resolve_model
from pipewright.models.spec import ModelSpec
from pipewright.options import option
from pipewright.runtime.parallel.moe_checks import check_moe_run


@dataclass(frozen=True)
class _TrainFields:
    """One training run. ``model``: a preset or family of :mod:`pipewright.models.presets`, whose
    dimensions the other model fields override; ``vocab`` None means the dataset's vocabulary (the
    embedding must fit the tokenizer); ``layout`` None means
    :func:`~pipewright.models.layout.uniform_layout` over pp × virtual stages; ``virtual`` None means
    the schedule's default. ``sequence_parallel`` / ``scatter_gather`` (tp > 1, not both): Megatron's
    sequence parallelism, and sending 1/t of each stage boundary tensor per tp rank. Global batch =
    microbatch_size × microbatches × dp. ``stop_after``: end (with a checkpoint) once that many steps
    are done, keeping the learning-rate schedule of ``steps`` (for runs split over several jobs: the
    next one passes ``resume``).

    Training options: ``recompute`` none|selective|full; ``precision`` fp32|bf16|fp16 (fp32
    master weights and optimizer state), ``reduce_fp32``: data-parallel gradient sums in fp32;
    ``shard_optimizer``: ZeRO-1 over dp; ``tie_embeddings``: output layer tied to the embedding (also
    across stages); ``kv_heads``: grouped-query attention (Llama); ``init_from``: a Hugging Face
    checkpoint folder whose config.json gives the model and whose safetensors give the weights."""

    model: str = option(
        "gpt-small-cpu",
        "--model",
        "preset (gpt-tiny, gpt-small-cpu, llama-tiny, gpt3-*, llama3-*) or family gpt|llama",
        group="model",
    )
    layers: int | None = option(None, "--layers", "transformer layers (default: the preset's)", group="model")
    hidden: int | None = option(None, "--hidden", "hidden size h (default: the preset's)", group="model")
    heads: int | None = option(None, "--heads", "attention heads (default: the preset's)", group="model")
    kv_heads: int | None = option(
        None,
        "--kv-heads",
        "key/value heads (grouped-query attention, Llama; default: --heads)",
        group="model",
    )
    ffn_hidden: int | None = option(None, "--ffn-hidden", "MLP hidden size (default 4h)", group="model")
    vocab: int | None = option(None, "--vocab", "vocabulary size (default: the dataset's)", group="model")
    seq_len: int | None = option(None, "--seq-len", "sequence length (default: the preset's)", group="model")
    layout: str | None = option(
        None, "--layout", "stage layout, e.g. 'Et*2|t*2L' (default: uniform)", group="layout"
    )
    schedule: str = option("1f1b", "--schedule", "schedule name or PyTorch schedule CSV", group="schedule")
    tp: int = option(1, "--tp", "tensor-parallel size", group="layout")
    sequence_parallel: bool = option(
        False,
        "--sequence-parallel",
        "with --tp: split LayerNorm/residual regions and boundaries along s",
        group="layout",
    )
    scatter_gather: bool = option(
        False,
        "--scatter-gather",
        "with --tp (not --sequence-parallel): each tp rank sends 1/t of a boundary",
        group="layout",
    )
    pp: int = option(2, "--pp", "pipeline-parallel size", group="layout")
    dp: int = option(1, "--dp", "data-parallel size", group="layout")
    cp: int = option(
        1, "--cp", "context-parallel size: ring attention over 2·cp sequence chunks", group="layout"
    )
    blocking_pairs: bool = option(
        False,
        "--blocking-pairs",
        "with --cp or --ep: run the schedule's F&B pairs (dualpipev, 1f1b-overlap) one after the other",
        group="layout",
    )
    virtual: int | None = option(
        None, "--virtual", "model chunks per pipeline rank (default: the schedule's)", group="layout"
    )
    microbatches: int = option(
        4, "--microbatches", "microbatches per data-parallel replica", group="schedule"
    )
    microbatch_size: int = option(8, "--microbatch-size", "sequences per microbatch", group="schedule")
    steps: int = option(200, "--steps", "training steps", group="schedule")
    lr: float = option(3e-3, "--lr", "peak learning rate", group="optimizer")
    warmup: int = option(20, "--warmup", "warm-up steps", group="optimizer")
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = option(
        "adamw", "--optimizer", "adamw or sgd, or an optimizer a feature provides", group="optimizer"
    )
    seed: int = option(0, "--seed", "seed for weights and data order", group="data")
    data: str | None = option(
        None, "--data", "token file (.bin/.npy), text file or folder (default: built-in corpus)", group="data"
    )
    tokenizer: str = option("byte", "--tokenizer", "byte or bpe:N (for text data)", group="data")
    out: str | None = option(
        None, "--out", "output folder (default runs/<timestamp>)", group="checkpoints and reliability"
    )
    checkpoint_every: int = option(
        0,
        "--checkpoint-every",
        "save a checkpoint every N steps (0: only at the end)",
        group="checkpoints and reliability",
    )
    resume: bool = option(
        False, "--resume", "continue from --out's checkpoint", group="checkpoints and reliability"
    )
    overwrite: bool = option(
        False,
        "--overwrite",
        "an --out that holds a run: move that run aside (to <out>.replaced-<time>), start anew",
        group="checkpoints and reliability",
    )  # runtime/checkpointing/run_folder.py
    stop_after: int | None = option(
        None,
        "--stop-after",
        "stop (with a checkpoint) after N steps; continue later with --resume",
        group="checkpoints and reliability",
    )
    eval_every: int = option(
        50, "--eval-every", "validation loss every N steps (0: never)", group="checkpoints and reliability"
    )
    eval_batches: int = 2
    recv_timeout_s: float = option(
        300.0,
        "--recv-timeout",
        "seconds a receive may wait before the run fails (with a hang report)",
        group="checkpoints and reliability",
    )
    collective_timeout_s: float = option(
        600.0,
        "--collective-timeout",
        "seconds a collective may wait before the run fails (hang report)",
        group="checkpoints and reliability",
    )  # every blocking collective (runtime/reliability/timeouts.py)
    # reliability (docs/reliability.md): checkpoints kept (0: all), restarts after a worker failure,
    # and what a NaN/inf loss or gradient does ("stop" or "skip" the step)
    keep_checkpoints: int = option(
        0,
        "--keep-checkpoints",
        "keep only the newest K checkpoints (0: all)",
        group="checkpoints and reliability",
    )
    max_restarts: int = option(
        0,
        "--max-restarts",
        "restart the workers from the latest checkpoint up to N times after a failure",
        group="checkpoints and reliability",
    )
    on_nonfinite: str = option(
        "stop",
        "--on-nonfinite",
        "stop or skip: what a NaN/inf loss or gradient does to its step",
        group="checkpoints and reliability",
    )
    on_save_error: str = option(
        "stop",
        "--on-save-error",
        "stop, retry or skip: what a failed checkpoint save does (the last one is kept)",
        group="checkpoints and reliability",
    )  # runtime/checkpointing/save_errors.py
    progress: bool = option(True, "--no-progress", "no progress bar", group="output")
    artifacts: bool = option(
        True, "--no-artifacts", "no loss.png, timeline.png or trace.json", group="output"
    )
    recompute: str = option(
        "none",
        "--recompute",
        "activation recomputation: none, selective (attention core) or full (per layer)",
        group="precision and memory",
    )
    precision: str = option(
        "fp32",
        "--precision",
        "fp32, bf16 or fp16 (fp32 master weights and optimizer state; fp16 loss scaling)",
        group="precision and memory",
    )
    reduce_fp32: bool = option(
        False,
        "--reduce-fp32",
        "with --precision bf16/fp16: sum data-parallel gradients in fp32",
        group="precision and memory",
    )
    shard_optimizer: bool = option(
        False,
        "--shard-optimizer",
        "ZeRO-1: each data-parallel rank keeps 1/dp of the optimizer state",
        group="precision and memory",
    )
    compile: bool = option(
        False,
        "--compile",
        "torch.compile each stage's forward (a stage that cannot compile runs eagerly, with a warning)",
        group="precision and memory",
    )
    tie_embeddings: bool = option(
        False,
        "--tie-embeddings",
        "tie the output layer to the input embedding (also across stages)",
        group="model",
    )
    # mixture of experts (models/moe_mlp.py; None: the preset's) and expert parallelism (carved from dp)
    moe_experts: int | None = option(
        None, "--moe-experts", "routed experts per MoE layer (0: dense)", group="model"
    )
    moe_top_k: int | None = option(None, "--moe-top-k", "experts each token is routed to", group="model")
    moe_shared_experts: int | None = option(
        None, "--moe-shared-experts", "experts every token passes through", group="model"
    )
    moe_ffn_hidden: int | None = option(None, "--moe-ffn-hidden", "expert MLP hidden size", group="model")
    moe_dense_layers: int | None = option(
        None, "--moe-dense-layers", "first layers kept dense (no experts)", group="model"
    )
    moe_capacity: float | None = option(
        None, "--moe-capacity", "capacity factor (tokens over capacity dropped; 0: dropless)", group="model"
    )
    moe_aux_loss_coeff: float | None = option(
        None, "--moe-aux-loss-coeff", "load-balancing loss coefficient (default 0.01)", group="model"
    )
    moe_z_loss_coeff: float | None = option(
        None, "--moe-z-loss-coeff", "router z-loss coefficient (default 0)", group="model"
    )
    ep: int = option(1, "--ep", "expert-parallel size (divides --dp and the experts)", group="layout")
    init_from: str | None = option(
        None,
        "--init-from",
        "Hugging Face checkpoint folder (GPT-2 or Llama config.json + safetensors)",
        group="model",
    )
    hf_model: str | None = option(
        None,
        "--hf-model",
        "Hugging Face model folder or config.json, built with transformers (weights if model.safetensors)",
        group="model",
    )
    # the device (process) of each global rank in the mesh's tp-dp-pp order, comma-separated, e.g. "0,2,1,3"
    # (a `pipewright plan` device assignment, pipewright.mesh.Mesh's placement); None: rank r on process r
    placement: str | None = None
    cpu_allocator: str = option(
        "retain",
        "--cpu-allocator",
        "retain (CPU workers keep freed tensor memory) or system",
        group="precision and memory",
    )  # CPU workers keep freed tensor memory (runtime/setup/host_memory.py) or "system"
    # the features' options by flat name (a TOML ``[table]``'s keys as "table.key" until resolved)
    features: dict = field(default_factory=dict)


class TrainConfig(_TrainFields):
    """One training run (the fields of :class:`_TrainFields`). Keyword arguments that are not fields are
    feature options (``TrainConfig(toy_level=2)``, ``replace(config, toy_level=3)``): they
    are kept in :attr:`features` and read back as attributes."""

    def __init__(self, **values: object) -> None:
        names = {f.name for f in fields(_TrainFields)}
        extra = {k: values.pop(k) for k in list(values) if k not in names}
        values["features"] = {**dict(values.get("features") or {}), **extra}
        super().__init__(**values)

    def __getattr__(self, name: str) -> object:
        features = self.__dict__.get("features", {})
        if name in features:
            return features[name]
        raise AttributeError(f"{type(self).__name__} has no field or feature option {name!r}")

    def flat(self) -> dict:
        """Every field and feature option in one flat mapping (``config.json``, checkpoint metadata)."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "features"}, **out["features"]}

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], *, source: str = "config") -> TrainConfig:
        """Build from a mapping (TOML table); dashes in keys read as underscores. Keys that are not
        fields are kept as feature options: the composition root checks them against the registered
        features (an unknown key is then an error naming it)."""
        known = {f.name for f in fields(cls)} - {"features"}
        clean, extra = {}, {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name in known:
                clean[name] = value
            else:
                extra[name] = value
        from pipewright.runtime.setup.inputs import check_types

        check_types(_TrainFields, clean, source)  # wrong types: one line naming the key, not a traceback
        return cls(**clean, features=extra)

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        from pipewright.files import read_text

        path = Path(path)
        try:
            data = tomllib.loads(read_text(path, "config file"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        table = data.get("train", data)  # a [train] table or top-level keys
        values = {k: v for k, v in table.items() if not isinstance(v, dict)}
        for name, section in data.items():  # a feature's [table]: its keys as "table.key"
            if isinstance(section, dict) and name != "train":
                values.update({f"{name}.{key}": value for key, value in section.items()})
        return cls.from_mapping(values, source=str(path))

    def with_overrides(self, **values: object) -> TrainConfig:
        """Replace the values that are not None (command-line flags over the file)."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def placement_ranks(self) -> tuple[int, ...] | None:
        """:attr:`placement` as device indices (None: the identity); one-line error if it is not a list of
        integers."""
        if not self.placement:
            return None
        try:
            return tuple(int(x) for x in self.placement.split(","))
        except ValueError:
            raise ConfigError(
                f"placement {self.placement!r} must be comma-separated device indices, e.g. 0,2,1,3"
            ) from None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.microbatches * self.dp

    def num_layers(self) -> int:
        """The model's layer count, known without the data."""
        if self.hf_model:
            return self.model_spec().layers
        if self.init_from:
            from pipewright.models.hf_load import read_hf_spec

            return read_hf_spec(self.init_from).layers
        return self.layers or resolve_model(self.model, layers=self.layers, vocab=self.vocab or 1).layers

    def model_spec(self, dataset_vocab: int | None = None) -> ModelSpec:
        """The preset (or family) with the dimension flags applied; vocab defaults to the dataset's."""
        if self.hf_model:
            from pipewright.models.hf import read_spec

            spec = read_spec(self.hf_model, seq_len=self.seq_len)
        elif self.init_from:
            from pipewright.models.hf_load import read_hf_spec

            spec = read_hf_spec(self.init_from, seq_len=self.seq_len)
        else:
            spec = resolve_model(
                self.model,
                layers=self.layers,
                hidden=self.hidden,
                heads=self.heads,
                ffn_hidden=self.ffn_hidden,
                kv_heads=self.kv_heads,
                vocab=self.vocab or dataset_vocab,
                seq_len=self.seq_len,
                **{n: getattr(self, n) for n in MOE_FIELDS},
                attention_kind="mha",  # what the runtime builds (MLA and MTP are the cost model's)
                mtp_depth=0,
            )
        if self.tie_embeddings:
            spec = replace(spec, tied_embeddings=True)
        if dataset_vocab is not None and spec.vocab < dataset_vocab and spec.family == "hf":
            raise ConfigError(
                f"the data's vocabulary ({dataset_vocab}) exceeds the model's ({spec.vocab}); make the "
                f"token file with the model's tokenizer: pipewright data prepare --tokenizer {self.hf_model}"
            )
        if dataset_vocab is not None and spec.vocab < dataset_vocab:
            raise ConfigError(
                f"--vocab {spec.vocab} is smaller than the dataset's vocabulary ({dataset_vocab}); "
                f"use --vocab {dataset_vocab} or more"
            )
        split = ("heads", "ffn_hidden", "vocab") + (("seq_len",) if self.sequence_parallel else ())
        split += ("kv_heads",) if spec.family in ("llama", "hf") else ()
        for name in split:  # Megatron's tensor-parallel splits (and the sequence, under SP)
            if getattr(spec, name) % self.tp:
                flag = name.replace("_", "-")
                raise ConfigError(
                    f"--{flag} {getattr(spec, name)} is not divisible by --tp {self.tp}; choose t dividing it"
                )
        check_moe_run(self, spec)
        if self.cp != 1:  # 2·cp load-balanced chunks (runtime/parallel/cp)
            from pipewright.runtime.parallel.cp import check_context_parallel

            if self.hf_model:  # its layers run transformers' attention, which the ring does not replace
                raise ConfigError(
                    f"--cp {self.cp} does not support --hf-model yet (each rank would attend only to its "
                    "own tokens: a different model); use --cp 1, or a pipewright model (--model llama …)"
                )
            check_context_parallel(spec.seq_len, self.cp, self.tp, self.sequence_parallel)
        return spec

    def check(self) -> None:
        """Everything that can be checked without the data or the workers (one-line ConfigErrors)."""
        from pipewright.values import check_train

        for note in check_train(self):  # ranges and finiteness, same lines for flags and TOML
            logging.getLogger(__name__).warning("warning: %s", note)
        for name in ("tp", "pp", "dp", "cp", "microbatches", "microbatch_size", "steps"):
            if int(getattr(self, name)) < 1:
                flag = name.replace("_", "-")
                raise ConfigError(f"--{flag} must be at least 1 (got {getattr(self, name)})")
        for name in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})"
                )
        for name in ("checkpoint_every", "eval_every", "warmup", "keep_checkpoints", "max_restarts"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more")
        if (self.sequence_parallel or self.scatter_gather) and self.tp < 2:
            flag = "--sequence-parallel" if self.sequence_parallel else "--scatter-gather"
            raise ConfigError(f"{flag} needs tensor parallelism; add --tp 2 (or more) or drop {flag}")
        if self.sequence_parallel and self.scatter_gather:
            raise ConfigError(
                "--scatter-gather needs identical stage outputs on the tp ranks, which sequence parallelism "
                "splits (its boundaries already carry 1/t); drop one of --sequence-parallel, --scatter-gather"
            )
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"--stop-after must be at least 1 (got {self.stop_after})")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive (got {self.lr})")
        if self.placement_ranks() is not None:
            from pipewright.mesh import Mesh

            # one line if not a permutation
            Mesh(self.tp, self.pp, self.dp, placement=self.placement_ranks(), cp=self.cp)
        for name in ("recv_timeout_s", "collective_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number of seconds (got {getattr(self, name)})")
        self._check_training_options()
        from pipewright.runtime.reliability.nonfinite import check_policy

        check_policy(self.on_nonfinite)

    def _check_training_options(self) -> None:
        """Recompute / precision / sharding / init-from options (one-line ConfigErrors)."""
        from pipewright.runtime.core.precision import compute_dtype
        from pipewright.runtime.core.stage_recompute import check_recompute

        check_recompute(self.recompute)
        compute_dtype(self.precision)
        from pipewright.runtime.setup.host_memory import ALLOCATORS

        if self.cpu_allocator not in ALLOCATORS:
            raise ConfigError(
                f"--cpu-allocator {self.cpu_allocator!r}: choose one of {', '.join(ALLOCATORS)}"
            )
        if self.shard_optimizer and self.dp < 2:
            raise ConfigError(
                "--shard-optimizer shards over data parallelism; add --dp 2 (or more) or drop it"
            )
        if self.reduce_fp32 and self.precision == "fp32":
            raise ConfigError(
                "--reduce-fp32 is for --precision bf16/fp16; fp32 gradients already reduce in fp32"
            )
        if self.hf_model:
            from pipewright.models.hf.support import check_train_options

            check_train_options(self)
        if self.init_from:
            given = [
                n
                for n in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
                if getattr(self, n)
            ]
            if given:
                flags = ", ".join("--" + n.replace("_", "-") for n in given)
                raise ConfigError(
                    f"--init-from takes the model's dimensions from the checkpoint; drop {flags}"
                )
            if not (Path(self.init_from) / "config.json").is_file():
                raise ConfigError(
                    f"--init-from {self.init_from}: no config.json; give a Hugging Face checkpoint folder"
                )
