"""TrainConfig: everything ``pipewright train`` needs, a flat view of the run's
:class:`~pipewright.runspec.RunSpec` (:meth:`TrainConfig.from_spec`), checked before any worker starts.

Each field is the value of one RunSpec field (declared there once: type, default, flag, help); the
features' options are their own sections (:attr:`TrainConfig.features`, by feature name), checked and
completed by the composition root (:func:`pipewright.training.check_config`), which knows the
registered features."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec
from pipewright.runspec import RunSpec
from pipewright.runspec.fields import walk
from pipewright.runspec.model_sections import ModelSection
from pipewright.runspec.model_spec import model_spec as section_model_spec
from pipewright.runspec.model_spec import tied
from pipewright.runspec.run import Path as Path_
from pipewright.runspec.run import field_default, get, with_values
from pipewright.runtime.parallel.moe_checks import check_moe_run

#: Each RunSpec field by its dotted path (``"parallelism.tp"``).
_SPEC_FIELDS = {".".join(path): (path, f) for path, f, _ in walk(RunSpec)}


def at(path: str) -> Any:
    """A TrainConfig field holding the RunSpec value at ``path`` (``"parallelism.tp"``), with ``train``'s
    default for it (:func:`pipewright.runspec.defaults`): the field's one declaration is the spec's."""
    where, f = _SPEC_FIELDS[path]
    return field(default=field_default(where, f, "train"), metadata={"path": where})


@dataclass(frozen=True)
class TrainConfig:
    """One training run, each field the value of a :class:`~pipewright.runspec.RunSpec` field (its
    path in the field's metadata; :meth:`from_spec`). ``model``: a preset or family of
    :mod:`pipewright.models.presets`, whose dimensions the other model fields override; ``vocab`` None
    means the dataset's vocabulary (the embedding must fit the tokenizer); ``layout`` None means
    :func:`~pipewright.models.layout.uniform_layout` over pp × virtual stages; ``virtual`` None means
    the schedule's default. ``sequence_parallel`` / ``scatter_gather`` (tp > 1, not both): Megatron's
    sequence parallelism, and sending 1/t of each stage boundary tensor per tp rank. Global batch =
    microbatch_size × microbatches × dp. ``stop_after``: end (with a checkpoint) once that many steps
    are done, keeping the learning-rate schedule of ``steps`` (for runs split over several jobs: the
    next one passes ``resume``). ``placement``: the device (process) of each global rank in the mesh's
    tp-dp-pp order, comma-separated (a `pipewright plan` device assignment, :class:`pipewright.mesh.Mesh`'s
    placement; None: rank r on process r).

    Training options: ``recompute`` none|selective|full; ``precision`` fp32|bf16|fp16 (fp32
    master weights and optimizer state), ``reduce_fp32``: data-parallel gradient sums in fp32;
    ``shard_optimizer``: ZeRO-1 over dp; ``tie_embeddings``: output layer tied to the embedding (also
    across stages); ``kv_heads``: grouped-query attention (Llama); ``init_from``: a Hugging Face
    checkpoint folder whose config.json gives the model and whose safetensors give the weights.

    ``features``: each feature's options section by feature name (``config.features["vocab"].parallel``;
    the RunSpec's ``features``); ``feature_paths``: the ``--feature`` import paths (kept with the config
    so workers and restarts see the same features)."""

    model: str = at("model.model")
    layers: int | None = at("model.layers")
    hidden: int | None = at("model.hidden")
    heads: int | None = at("model.heads")
    kv_heads: int | None = at("model.kv_heads")
    ffn_hidden: int | None = at("model.ffn_hidden")
    vocab: int | None = at("model.vocab")
    seq_len: int | None = at("model.seq_len")
    tie_embeddings: bool = at("model.tie_embeddings")
    init_from: str | None = at("model.init_from")
    hf_model: str | None = at("model.hf_model")
    moe_experts: int | None = at("model.moe.experts")
    moe_top_k: int | None = at("model.moe.top_k")
    moe_shared_experts: int | None = at("model.moe.shared_experts")
    moe_ffn_hidden: int | None = at("model.moe.ffn_hidden")
    moe_dense_layers: int | None = at("model.moe.dense_layers")
    moe_capacity: float | None = at("model.moe.capacity")
    moe_aux_loss_coeff: float | None = at("model.moe.aux_loss_coeff")
    moe_z_loss_coeff: float | None = at("model.moe.z_loss_coeff")
    layout: str | None = at("parallelism.layout")
    tp: int = at("parallelism.tp")
    pp: int = at("parallelism.pp")
    dp: int = at("parallelism.dp")
    cp: int = at("parallelism.cp")
    ep: int = at("parallelism.ep")
    virtual: int | None = at("parallelism.virtual")
    sequence_parallel: bool = at("parallelism.sequence_parallel")
    scatter_gather: bool = at("parallelism.scatter_gather")
    blocking_pairs: bool = at("parallelism.blocking_pairs")
    placement: str | None = at("parallelism.placement")
    schedule: str = at("schedule.name")
    microbatches: int = at("batch.microbatches")
    microbatch_size: int = at("batch.microbatch_size")
    steps: int = at("training.steps")
    lr: float = at("training.lr")
    warmup: int = at("training.warmup")
    min_lr_ratio: float = at("training.min_lr_ratio")
    weight_decay: float = at("training.weight_decay")
    grad_clip: float = at("training.grad_clip")
    optimizer: str = at("training.optimizer")
    seed: int = at("training.seed")
    data: str | None = at("training.data")
    tokenizer: str = at("training.tokenizer")
    checkpoint_every: int = at("training.checkpoints.every")
    resume: bool = at("training.checkpoints.resume")
    stop_after: int | None = at("training.checkpoints.stop_after")
    eval_every: int = at("training.checkpoints.eval_every")
    eval_batches: int = at("training.checkpoints.eval_batches")
    recv_timeout_s: float = at("training.checkpoints.recv_timeout_s")
    collective_timeout_s: float = at("training.checkpoints.collective_timeout_s")
    keep_checkpoints: int = at("training.checkpoints.keep")
    max_restarts: int = at("training.checkpoints.max_restarts")
    on_nonfinite: str = at("training.checkpoints.on_nonfinite")
    on_save_error: str = at("training.checkpoints.on_save_error")
    out: str | None = at("output.out")
    overwrite: bool = at("output.overwrite")
    progress: bool = at("output.progress")
    artifacts: bool = at("output.artifacts")
    recompute: str = at("memory.recompute")
    shard_optimizer: bool = at("memory.shard_optimizer")
    cpu_allocator: str = at("memory.cpu_allocator")
    precision: str = at("precision.precision")
    reduce_fp32: bool = at("precision.reduce_fp32")
    compile: bool = at("framework.compile")
    gpu: str | None = at("cluster.gpu")
    features: Mapping[str, Any] = field(default_factory=dict)
    feature_paths: tuple[str, ...] = field(default=(), metadata={"path": ("extensions", "feature")})

    @classmethod
    def from_spec(cls, spec: RunSpec) -> TrainConfig:
        """The run a RunSpec describes: each field its value in ``spec``, the features' sections as
        they are, ``extensions.feature`` as :attr:`feature_paths`."""
        values = {f.name: get(spec, f.metadata["path"]) for f in fields(cls) if "path" in f.metadata}
        values["feature_paths"] = tuple(values["feature_paths"] or ())
        return cls(**values, features=dict(spec.features))

    def flat(self) -> dict:
        """Every field and feature option in one flat mapping (``config.json``, checkpoint metadata), a
        feature option under its flag's name (:func:`pipewright.options.flat_name`)."""
        from pipewright.options import fields_for, flat_name

        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "features"}
        for section in self.features.values():
            out |= {flat_name(f): getattr(section, f.name) for f in fields_for(type(section))}
        return out

    @classmethod
    def spec_values(
        cls, values: Mapping[str, object], *, source: str = "config"
    ) -> tuple[dict[Path_, object], dict[str, object]]:
        """A mapping of field names (a ``train`` TOML of flat keys; dashes read as underscores) as
        RunSpec values by path, type-checked (one line naming the key), and the keys that are no field
        (the features' options, which the composition root resolves)."""
        paths = {f.name: f.metadata["path"] for f in fields(cls) if "path" in f.metadata}
        clean, extra = {}, {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name in paths:
                clean[name] = value
            else:
                extra[key] = value
        from pipewright.values import check_types

        check_types(cls, clean, source)  # wrong types: one line naming the key, not a traceback
        return {paths[name]: value for name, value in clean.items()}, extra

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
        return self._model(1).layers  # any vocabulary: a family without --vocab takes the dataset's

    def model_section(self) -> ModelSection:
        """The RunSpec model section of this config's model fields, with what the runtime builds:
        multi-head attention and no multi-token-prediction module (MLA and MTP are the cost model's)."""
        given = {
            f.metadata["path"][1:]: getattr(self, f.name)
            for f in fields(self)
            if f.metadata.get("path", ("",))[0] == "model"
        }
        return with_values(ModelSection(), {**given, ("attention_kind",): "mha", ("mtp_depth",): 0})

    def _model(self, dataset_vocab: int | None) -> ModelSpec:
        """The model before the run's checks: a Hugging Face model's (``hf_model``, ``init_from``: read
        from its config) or the model section's (:func:`pipewright.runspec.model_spec.model_spec`, what
        ``simulate`` prices, its embeddings tied if asked; vocab defaults to the dataset's)."""
        if self.hf_model:
            from pipewright.models.hf import read_spec

            return read_spec(self.hf_model, seq_len=self.seq_len)  # ties as its config says
        if self.init_from:
            from pipewright.models.hf_load import read_hf_spec

            return tied(read_hf_spec(self.init_from, seq_len=self.seq_len), self.model_section())
        return section_model_spec(self.model_section(), dataset_vocab)

    def model_spec(self, dataset_vocab: int | None = None) -> ModelSpec:
        """The model trained (:meth:`_model`), checked against the data's vocabulary and the run's
        tensor, sequence, expert and context parallelism (one-line ConfigErrors)."""
        spec = self._model(dataset_vocab)
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
        if self.gpu is not None:
            from pipewright.hardware import accelerator

            accelerator(self.gpu)  # an unknown name: one line listing the presets
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


def read_train_toml(path: str | Path) -> dict[str, object]:
    """The values of a ``train`` TOML file of the older form: top-level keys or a ``[train]`` table named
    like the fields (or the flags), and a feature's ``[table]`` (its keys as ``"table.key"``)."""
    import tomllib

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
    return values
