"""Model family → stage builder (``ModelSpec.family``): the runtime builds any family's stages through
:func:`build_stage` / :func:`build_full` without knowing the model files. A family's builder has the
signature of :func:`pipewright.models.gpt.build_stage`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from torch import nn

from pipewright.errors import ConfigError
from pipewright.models import gpt
from pipewright.models import llama_decoder as llama
from pipewright.models.spec import ModelSpec


def _hf_build_stage(*args, **kwargs) -> nn.Module:
    """Hugging Face models (:mod:`pipewright.models.hf`), imported when used (transformers is optional)."""
    from pipewright.models.hf import build_stage as hf_build_stage

    return hf_build_stage(*args, **kwargs)


STAGE_BUILDERS: Mapping[str, Callable[..., nn.Module]] = MappingProxyType(
    {"gpt": gpt.build_stage, "bert": gpt.build_stage, "llama": llama.build_stage, "hf": _hf_build_stage}
)


def build_stage(spec: ModelSpec, layout, stage_index: int, **kwargs) -> nn.Module:
    """Stage ``stage_index`` of ``spec``'s family (keyword arguments as ``gpt.build_stage``)."""
    try:
        builder = STAGE_BUILDERS[spec.family]
    except KeyError:
        raise ConfigError(
            f"no runtime model for family {spec.family!r}; use one of {sorted(STAGE_BUILDERS)}"
        ) from None
    return builder(spec, layout, stage_index, **kwargs)


def build_full(spec: ModelSpec, seed: int = 0, **kwargs) -> nn.Module:
    """The whole model as one stage: the single-process reference."""
    return build_stage(spec, None, 0, seed=seed, num_stages=1, **kwargs)
