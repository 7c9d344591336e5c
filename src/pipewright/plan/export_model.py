"""The architecture a plan was priced for, as the trainers' exports describe it: the plan file's
``"model"`` read back as a :class:`~pipewright.models.spec.ModelSpec`, with the normalization and the
position embedding each family builds.

A plan written before the file recorded the architecture (family, tied embeddings, rotary base, the
mixture-of-experts fields) takes the missing fields from the preset of the plan's model name, or from
the family its MLP implies (SwiGLU: Llama, else GPT), and says so in a note: an export never guesses
silently.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from pipewright.errors import ConfigError
from pipewright.models.presets import MOE_FIELDS
from pipewright.models.spec import ModelSpec
from pipewright.plan.planfile import ARCH_FIELDS

#: family → (normalization, position embedding) as the runtime builds it (models/gpt.py: LayerNorm and
#: learned absolute positions; models/llama.py: RMSNorm and rotary embeddings).
FAMILY_SHAPE = MappingProxyType(
    {
        "gpt": ("LayerNorm", "learned_absolute"),
        "llama": ("RMSNorm", "rope"),
    }
)


@dataclass(frozen=True)
class Architecture:
    """The plan's model (``spec``, its padded vocabulary) and what was assumed for an older plan."""

    spec: ModelSpec
    padded_vocab: int
    assumed: tuple[str, ...] = ()

    @property
    def normalization(self) -> str:
        return FAMILY_SHAPE[self.spec.family][0]

    @property
    def position_embedding(self) -> str:
        return FAMILY_SHAPE[self.spec.family][1]


def architecture(model: dict[str, Any]) -> Architecture:
    """The :class:`Architecture` of a plan file's ``"model"`` (older plans: missing fields from the
    preset of the same name, else the family's defaults, listed in ``assumed``)."""
    from pipewright.models.presets import PRESETS

    known = {f.name for f in fields(ModelSpec)}
    values = {k: v for k, v in model.items() if k in known}
    missing = [k for k in ARCH_FIELDS if k not in model]
    assumed: list[str] = []
    if missing:
        preset = PRESETS.get(str(model.get("name")))
        if preset is not None and all(
            getattr(preset, d) == model.get(d) for d in ("layers", "hidden", "heads")
        ):
            absent = [k for k in (*ARCH_FIELDS, *MOE_FIELDS) if k not in model]
            values = {**{k: getattr(preset, k) for k in absent}, **values}
            assumed.append(
                f"the plan file does not record {', '.join(missing)}; taken from preset {preset.name}"
            )
        elif "family" not in model:
            values["family"] = "llama" if model.get("mlp") == "swiglu" else "gpt"
            assumed.append(
                f"the plan file does not record the model's family; taken as {values['family']} from its MLP"
            )
    if values.get("family") not in FAMILY_SHAPE:
        raise ConfigError(
            f"the plan's model family {values.get('family')!r} has no export "
            f"(one of {', '.join(FAMILY_SHAPE)})"
        )
    spec = ModelSpec(**values)
    return Architecture(spec, int(model.get("padded_vocab") or spec.vocab), tuple(assumed))
