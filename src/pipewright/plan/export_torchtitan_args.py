"""A plan as torchtitan 0.3.0's command line: ``--module M --config C`` (a function of torchtitan's
``config_registry`` returning its Python ``Trainer.Config``) and ``--section.field value`` overrides,
which ``torchtitan.config.ConfigManager`` parses with tyro. torchtitan 0.3.0 reads no TOML; the TOML
export (plan/export_torchtitan.py) is for 0.2.2.

The same settings as the TOML (its tables, :func:`~pipewright.plan.export_torchtitan.torchtitan_config`),
in 0.3.0's names: the output layer is ``lm_head`` (0.2.2: ``output``), asynchronous tensor parallelism is
``--compile.enable_async_tensor_parallel``, activation checkpointing a subcommand
(``activation-checkpoint:selective|full|none``), and a pipeline needs ``--training.disable_cuda_graphs``
(0.3.0 refuses CUDA graphs with pipeline parallelism). The config function is the one of the plan's
model (:data:`CONFIGS`); one with settings of its own that the plan does not price (float8 linears) gets
a note. Every parallelism field is given, so the config function's own degrees do not remain.
"""

from __future__ import annotations

import shlex

from pipewright.plan.export import summary
from pipewright.plan.export_model import architecture
from pipewright.plan.export_torchtitan import model_table, torchtitan_config, torchtitan_notes
from pipewright.plan.planfile import Plan

RELEASE = "0.3.0"
#: (train spec, flavor) of :data:`~pipewright.plan.export_torchtitan.FLAVORS` → torchtitan 0.3.0's
#: config function (``torchtitan/models/*/config_registry.py``) and what it sets that the plan does not.
CONFIGS = {
    ("llama3", "8B"): ("llama3_8b", ""),
    ("llama3", "70B"): ("llama3_70b", ""),
    ("llama3", "405B"): ("llama3_405b", "float8 linears (its model converters)"),
    ("deepseek_v3", "671B"): ("deepseek_v3_671b", ""),
}
_AC = {"none": "none", "selective": "selective", "op": "selective", "full": "full"}


def torchtitan_args(plan: Plan, schedule_csv: str | None = None) -> list[str]:
    """torchtitan 0.3.0's arguments for ``plan`` (module docstring)."""
    tables = torchtitan_config(plan, schedule_csv)
    model = tables["model"]
    module, config = model["name"], CONFIGS.get((model["name"], model["flavor"]), (model["flavor"], ""))[0]
    args = ["--module", str(module), "--config", str(config)]
    para = dict(tables["parallelism"])
    async_tp = bool(para.pop("enable_async_tensor_parallel"))
    if "module_fqns_per_model_part" in para:
        parts = para.pop("module_fqns_per_model_part")
        renamed = [["lm_head" if m == "output" else m for m in part] for part in parts]
        args += ["--parallelism.module_fqns_per_model_part", *(",".join(p) for p in renamed)]
    para["enable_sequence_parallel"] = bool(plan.data.get("sequence_parallel"))
    args += _fields("parallelism", para)
    args += _fields("training", tables["training"])
    if int(plan["pp"]) > 1:
        args.append("--training.disable_cuda_graphs")
    if async_tp:
        args += ["--compile.enable", "--compile.enable_async_tensor_parallel"]
    args.append(f"activation-checkpoint:{_AC[tables['activation_checkpoint']['mode']]}")
    return args


def _fields(section: str, values: dict[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in values.items():
        if isinstance(value, bool):
            out.append(f"--{section}.{key}" if value else f"--{section}.no_{key}")
        elif value is not None:
            out += [f"--{section}.{key}", str(value)]
    return out


def torchtitan_args_notes(plan: Plan) -> list[str]:
    """The TOML's notes (less its flavor and release lines) and the config function's."""
    model, flavor_notes = model_table(architecture(plan["model"]))
    out = [n for n in torchtitan_notes(plan) if n not in flavor_notes and not n.startswith("written for")]
    found = CONFIGS.get((model["name"], model["flavor"]))
    if found is None:
        out.insert(
            0,
            f"torchtitan {RELEASE} has no config function for the plan's model: add {model['flavor']!r} to "
            f"the config_registry of module {model['name']!r} (torchtitan refuses --config until then)",
        )
    elif found[1] and plan.data.get("dtype", "bf16") != "fp8":
        out.append(f"torchtitan {RELEASE}'s {found[0]} trains with {found[1]}; the plan prices bf16")
    return out


def torchtitan_args_text(plan: Plan, source: str = "plan", schedule_csv: str | None = None) -> str:
    """A shell fragment: comment lines and ``TORCHTITAN_ARGS=(…)`` for ``torchrun -m torchtitan.train``."""
    args = torchtitan_args(plan, schedule_csv)
    lines = [f"# torchtitan {RELEASE} arguments of {source}: {summary(plan)}"]
    lines += [f"# note: {n}" for n in torchtitan_args_notes(plan)]
    lines.append("TORCHTITAN_ARGS=(")
    i = 0
    while i < len(args):
        n = 1
        while i + n < len(args) and not args[i + n].startswith("--") and ":" not in args[i + n]:
            n += 1
        lines.append("  " + " ".join(shlex.quote(a) for a in args[i : i + n]))
        i += n
    lines.append(")")
    return "\n".join(lines) + "\n"
