"""TrainConfig: everything ``pipewright train`` needs, from flags and/or a TOML file, checked before any
worker starts."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.models.presets import resolve_model
from pipewright.models.spec import ModelSpec


@dataclass(frozen=True)
class TrainConfig:
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

    model: str = "gpt-small-cpu"
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    seq_len: int | None = None
    layout: str | None = None
    schedule: str = "1f1b"
    tp: int = 1
    sequence_parallel: bool = False
    scatter_gather: bool = False
    pp: int = 2
    dp: int = 1
    virtual: int | None = None
    microbatches: int = 4
    microbatch_size: int = 8
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "adamw"
    kfac_opportunistic: bool = False  # --optimizer kfac: run pending K-FAC tasks while a receive waits
    kfac_base: str = "adamw"  # --optimizer kfac: the update the preconditioned gradient feeds
    kfac_fill: str = "measured"  # --optimizer kfac: what a bubble runs, "measured" (what fits) or "all"
    weight_policy: str = "stash"  # asynchronous schedules only: pipewright.features.async_weights
    async_window: int = 10  # asynchronous schedules: steps per flush-free executor window
    seed: int = 0
    data: str | None = None
    tokenizer: str = "byte"
    out: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False  # an --out holding a run: move it aside (runtime/run_folder.py)
    stop_after: int | None = None
    eval_every: int = 50
    eval_batches: int = 2
    recv_timeout_s: float = 300.0
    collective_timeout_s: float = 600.0  # every blocking collective (runtime/timeouts.py)
    # reliability (docs/reliability.md): checkpoints kept (0: all), restarts after a worker failure,
    # and what a NaN/inf loss or gradient does ("stop" or "skip" the step)
    keep_checkpoints: int = 0
    max_restarts: int = 0
    on_nonfinite: str = "stop"
    on_save_error: str = "stop"  # a failed checkpoint save: stop, retry or skip (runtime/save_errors.py)
    progress: bool = True
    artifacts: bool = True
    recompute: str = "none"
    precision: str = "fp32"
    reduce_fp32: bool = False
    shard_optimizer: bool = False
    tie_embeddings: bool = False
    init_from: str | None = None
    # the device (process) of each global rank in the mesh's tp-dp-pp order, comma-separated, e.g. "0,2,1,3"
    # (a `pipewright plan` device assignment, pipewright.mesh.Mesh's placement); None: rank r on process r
    placement: str | None = None
    vocab_parallel: str = "none"  # none, naive, alg1 or alg2: pipewright.features.vocab
    cpu_allocator: str = "retain"  # CPU workers keep freed tensor memory (runtime/host_memory.py) or "system"

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], *, source: str = "config") -> TrainConfig:
        """Build from a mapping (TOML table); dashes in keys read as underscores; unknown keys are an
        error naming the key."""
        known = {f.name for f in fields(cls)}
        clean = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
            clean[name] = value
        from pipewright.runtime.inputs import check_types

        check_types(cls, clean, source)  # wrong types: one line naming the key, not a traceback later
        return cls(**clean)

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
        return cls.from_mapping(table, source=str(path))

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
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.microbatches * self.dp

    def num_layers(self) -> int:
        """The model's layer count, known without the data."""
        if self.init_from:
            from pipewright.models.hf_load import read_hf_spec

            return read_hf_spec(self.init_from).layers
        return self.layers or resolve_model(self.model, layers=self.layers, vocab=self.vocab or 1).layers

    def model_spec(self, dataset_vocab: int | None = None) -> ModelSpec:
        """The preset (or family) with the dimension flags applied; vocab defaults to the dataset's."""
        if self.init_from:
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
            )
        if self.tie_embeddings:
            spec = replace(spec, tied_embeddings=True)
        if dataset_vocab is not None and spec.vocab < dataset_vocab:
            raise ConfigError(
                f"--vocab {spec.vocab} is smaller than the dataset's vocabulary ({dataset_vocab}); "
                f"use --vocab {dataset_vocab} or more"
            )
        split = ("heads", "ffn_hidden", "vocab") + (("seq_len",) if self.sequence_parallel else ())
        split += ("kv_heads",) if spec.family == "llama" else ()
        for name in split:  # Megatron's tensor-parallel splits (and the sequence, under SP)
            if getattr(spec, name) % self.tp:
                flag = name.replace("_", "-")
                raise ConfigError(
                    f"--{flag} {getattr(spec, name)} is not divisible by --tp {self.tp}; choose t dividing it"
                )
        return spec

    def check(self) -> None:
        """Everything that can be checked without the data or the workers (one-line ConfigErrors)."""
        from pipewright.values import check_train

        for note in check_train(self):  # ranges and finiteness, same lines for flags and TOML
            logging.getLogger(__name__).warning("warning: %s", note)
        from pipewright.features.kfac.feature import check_config as check_kfac

        check_kfac(self)  # --kfac-base, --kfac-opportunistic
        for name in ("tp", "pp", "dp", "microbatches", "microbatch_size", "steps"):
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

            Mesh(self.tp, self.pp, self.dp, placement=self.placement_ranks())  # one line if not a permutation
        for name in ("recv_timeout_s", "collective_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number of seconds (got {getattr(self, name)})")
        self._check_runtime_features()
        from pipewright.optim import OPTIMIZERS
        from pipewright.runtime.nonfinite import check_policy

        check_policy(self.on_nonfinite)

        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")

    def _check_runtime_features(self) -> None:
        """Recompute / precision / sharding / init-from options (one-line ConfigErrors)."""
        from pipewright.runtime.precision import compute_dtype
        from pipewright.runtime.recompute import check_recompute

        check_recompute(self.recompute)
        compute_dtype(self.precision)
        from pipewright.runtime.host_memory import ALLOCATORS

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
    record: dict = {"model": dims, "tokenizer": tokenizer}
    if tp > 1:
        record["tensor_parallel"] = {"tp": tp, "embedding": "vocab-parallel"}
    text = json.dumps(record, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
