"""The plan file ``pipewright plan`` writes and ``simulate --plan`` / ``train --plan`` read.

Schema (JSON)::

    {"format": "pipewright-plan", "version": 1,
     "model": {"name": "gpt3-175b", "layers": 96, "hidden": 12288, "heads": 96, "ffn_hidden": 49152,
               "vocab": 50257, "seq_len": 2048},
     "topology": "128x8-a100-80gb", "devices": ["node0/gpu0", …],   # device of global rank g
     "tp": 8, "pp": 8, "dp": 16, "virtual": 1, "schedule": "1f1b",
     "microbatch_size": 1, "microbatches": 96, "global_batch_size": 1536,
     "recompute": "selective", "sequence_parallel": true, "dtype": "bf16",
     "layout": "Et*12|t*12|…|t*12L",                                 # models/layout.py's string
     "predicted": {"iteration_time_s": …, "peak_memory_bytes": …},
     "baselines": [{"name": "megatron", "iteration_time_s": …, "config": "…"}, …],
     "runner_ups": [{"config": "…", "iteration_time_s": …, "why": "…"}, …]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

FORMAT = "pipewright-plan"
_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")


@dataclass(frozen=True)
class Plan:
    """A plan read back from its file (the fields the commands apply)."""

    data: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def layout(self) -> str:
        return self.data["layout"]

    @property
    def devices(self) -> list[str]:
        return list(self.data["devices"])

    def schedule_csv(self, plan_path: str | Path) -> str | None:
        """The generated schedule's CSV (beside the plan file), or None for a schedule built by name."""
        name = self.data.get("schedule_csv")
        if not name:
            return None
        path = Path(plan_path).parent / name
        if not path.is_file():
            raise ConfigError(f"the plan's schedule file {path} is missing; keep it beside the plan")
        return str(path)

    def chunk_layers(self) -> tuple[int, ...]:
        from pipewright.models.layout import parse_layout

        return tuple(len(s.layers) for s in parse_layout(self.layout).stages)

    def check_model(self, spec: ModelSpec) -> None:
        """One-line error when the plan was made for a model of other dimensions."""
        model = self.data["model"]
        diff = [
            f"{d} {model[d]} (plan) vs {getattr(spec, d)}" for d in _DIMS if model.get(d) != getattr(spec, d)
        ]
        if diff:
            raise ConfigError(
                f"the plan was made for model {model.get('name')!r}, not this one ({'; '.join(diff)}); "
                "run `pipewright plan` for this model or pass the plan's model"
            )


def model_json(spec: ModelSpec) -> dict[str, Any]:
    return {"name": spec.name, **{d: getattr(spec, d) for d in _DIMS}}


def save(data: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load(path: str | Path) -> Plan:
    """Read a plan file; one-line error on a missing file or another format."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read plan {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"plan {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f'{path} is not a plan file: expected "format": "{FORMAT}"')
    return Plan(data)
