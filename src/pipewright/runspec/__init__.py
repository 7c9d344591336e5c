"""RunSpec: one typed, nested description of a run, read from TOML and from command-line flags
generated from its fields (docs/run-spec.md).

- :class:`RunSpec` and its sections (:mod:`.model_sections`, :mod:`.cluster_sections`,
  :mod:`.run_sections`, :mod:`.training_sections`, :mod:`.command_sections`; each field declared once
  with :func:`~pipewright.runspec.fields.spec_field`; closed choices named in :mod:`.choices`), and
  each registered feature's section under ``features``;
- :func:`defaults` (a command's defaults), :func:`validate` (the one check);
- :func:`load_toml` / :func:`loads_toml` / :func:`dump_toml` (TOML in and out);
- :func:`add_spec_flags` / :func:`spec_from_args` / :func:`spec_to_argv` (flags in and out).
"""

from pipewright.runspec.flags import add_spec_flags, spec_from_args, spec_to_argv
from pipewright.runspec.run import RunSpec, defaults, feature_sections, values, with_values
from pipewright.runspec.toml_io import dump_toml, load_toml, loads_toml
from pipewright.runspec.validation import validate

__all__ = [
    "RunSpec",
    "add_spec_flags",
    "defaults",
    "dump_toml",
    "feature_sections",
    "load_toml",
    "loads_toml",
    "spec_from_args",
    "spec_to_argv",
    "validate",
    "values",
    "with_values",
]
