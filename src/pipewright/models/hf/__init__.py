"""Hugging Face causal language models as pipeline stages: ``pipewright train --hf-model DIR``.

:mod:`.adapters` (where each family keeps its modules), :mod:`.stage` (the stage module and the
per-stage positions, rotary tables and masks), :mod:`.linears` (deferrable and tensor-parallel linear
layers), :mod:`.build` (config, weights, the stage builder registered as family "hf")."""

from pipewright.models.hf.build import build_stage, full_model, load_config, read_spec
from pipewright.models.hf.stage import hf_parameter_name

__all__ = ["build_stage", "full_model", "hf_parameter_name", "load_config", "read_spec"]
