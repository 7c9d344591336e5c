"""ProfiledCost: measured per-action times behind the CostModel interface.

**Profile format** (what ``pipewright profile`` writes). CSV, one measurement per row, ``#`` lines are
comments; the first non-comment line is the header::

    # model=gpt-tiny device=cpu seq_len=64 dtype=fp32
    layer_type,microbatch_size,kind,seconds,bytes
    embedding,1,F,0.00011,16384
    layer,1,F,0.00102,296960
    layer,1,B,0.00201,
    output,1,F,0.00034,65536
    layer,1,PARAMS,0,201216
    layer,1,MESSAGE,0,16384

- ``layer_type``: ``embedding`` (chunk 0), ``layer`` (one transformer layer; a chunk holds several),
  ``output`` (logit layer + loss, last chunk).
- ``kind``: an action kind — F, B, I, W, or an extension kind (``KFAC_KRON``, ``KFAC_INV``,
  ``KFAC_PREC``, …) — with its ``seconds`` for one microbatch of ``microbatch_size`` sequences; and two
  size-only kinds: ``PARAMS`` (``bytes`` = static memory — parameters, gradients, optimizer state — of
  one ``layer_type``) and ``MESSAGE`` (``bytes`` a stage sends to the next per microbatch; ``seconds``:
  its measured one-way time, 0 when not measured — :class:`ProfiledComm` uses it). ``pipewright
  profile`` also writes ``STEP`` rows: the optimizer step over one ``layer_type``'s parameters.
- ``bytes`` (optional column) on an F row: the activation memory that forward keeps until its backward.

The JSON form holds the same rows: ``{"format": "pipewright-profile", "version": 1, "meta": {...},
"rows": [{"layer_type": "layer", "microbatch_size": 1, "kind": "F", "seconds": 0.001, "bytes": 0}]}``.

**Filling gaps.** Where only B is measured, I = W = B/2; where I and W are, B = I + W. A layer type
without a row for a kind costs 0 for it. Activation memory: F adds its bytes, B frees them, I frees
them all and W nothing (without a measured split). An extension kind's action costs the per-layer
value times the chunk's layers, or one layer's value when the action's payload names a layer.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pipewright.cost.placement import layer_counts, roles
from pipewright.errors import ConfigError
from pipewright.ir import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, Action, B, F, I, Schedule, W
from pipewright.models.layout import Layout

FORMAT = "pipewright-profile"
LAYER_TYPES = ("embedding", "layer", "output")
COLUMNS = ("layer_type", "microbatch_size", "kind", "seconds", "bytes")
PARAMS = "PARAMS"
MESSAGE = "MESSAGE"

#: Layers of the models PipeFisher profiled (T5: encoder + decoder blocks).
PIPEFISHER_LAYERS: Mapping[str, int] = MappingProxyType(
    {"bert-base": 12, "bert-large": 24, "opt-125m": 12, "opt-350m": 24, "t5-base": 24, "t5-large": 48}
)
MIB = 1024 * 1024


@dataclass(frozen=True)
class ProfileRow:
    layer_type: str
    microbatch_size: int
    kind: str
    seconds: float = 0.0
    bytes: float = 0.0


#: the largest time (s) and size (bytes) a profile row may hold: beyond them a value is damage
MAX_SECONDS, MAX_BYTES = 1e6, 2.0**60


#: the kinds whose rows carry a size (activation, parameters, message); the others' bytes may be left out
SIZED_KINDS = frozenset({"F", "PARAMS", "MESSAGE"})


def _number(value: Any, *, empty_is_zero: bool = False) -> float:
    """A row's number: JSON's number (null: 0, not measured) or CSV's text; an empty cell is 0 only
    where ``empty_is_zero`` (a backward row's bytes, as hand-written profiles leave them); a bool, list,
    object or other empty cell is a TypeError."""
    if value is None or (value == "" and empty_is_zero):
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float | str) or value == "":
        raise TypeError(value)
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError(value)
    return int(value)


def _row(item: Mapping[str, Any], where: str) -> ProfileRow:
    try:
        row = ProfileRow(
            str(item["layer_type"]),
            _count(item["microbatch_size"]),
            str(item["kind"]),
            _number(item.get("seconds")),
            _number(item.get("bytes"), empty_is_zero=str(item.get("kind")) not in SIZED_KINDS),
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        raise ConfigError(
            f"{where}: needs layer_type, microbatch_size (an integer), kind and numeric seconds/bytes"
        ) from None
    if not (row.seconds <= MAX_SECONDS and row.bytes <= MAX_BYTES):
        raise ConfigError(
            f"{where}: {row.seconds:g} s, {row.bytes:g} bytes is beyond any measurement (at most "
            f"{MAX_SECONDS:g} s and {MAX_BYTES:g} bytes)"
        )
    if row.layer_type not in LAYER_TYPES:
        raise ConfigError(f"{where}: layer_type {row.layer_type!r} is not one of {', '.join(LAYER_TYPES)}")
    if row.microbatch_size < 1:
        raise ConfigError(f"{where}: microbatch_size must be at least 1 (got {row.microbatch_size})")
    if not (math.isfinite(row.seconds) and row.seconds >= 0 and math.isfinite(row.bytes) and row.bytes >= 0):
        raise ConfigError(f"{where}: seconds and bytes must be finite and not negative")
    return row


def read_profile_csv(text: str) -> tuple[tuple[ProfileRow, ...], dict[str, str]]:
    """Rows and ``key=value`` metadata from the comment lines of a profile CSV."""
    meta: dict[str, str] = {}
    lines = []
    for line in text.splitlines():
        if line.startswith("#"):
            for token in line[1:].split():
                if "=" in token:
                    k, v = token.split("=", 1)
                    meta[k] = v
        elif line.strip():
            lines.append(line)
    reader = csv.DictReader(lines)
    missing = {"layer_type", "microbatch_size", "kind"} - set(reader.fieldnames or ())
    if missing:
        raise ConfigError(
            f"profile CSV lacks column(s) {', '.join(sorted(missing))}; header is {','.join(COLUMNS)}"
        )
    return tuple(_row(item, f"profile line {i + 2}") for i, item in enumerate(reader)), meta


def write_profile_csv(rows: Iterable[ProfileRow], meta: Mapping[str, object] | None = None) -> str:
    out = io.StringIO()
    if meta:
        out.write("# " + " ".join(f"{k}={v}" for k, v in meta.items()) + "\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([r.layer_type, r.microbatch_size, r.kind, repr(r.seconds), repr(r.bytes)])
    return out.getvalue()


def mean_profile(
    profiles: Sequence[tuple[Sequence[ProfileRow], Mapping[str, str]]],
) -> tuple[tuple[ProfileRow, ...], dict[str, str]]:
    """Several profiles of one model (e.g. taken before and after a run) merged into one: every
    (layer type, microbatch size, kind) gets the mean of its measured times (a ``seconds`` of 0 — not
    measured — is left out; 0 when no profile measured it), sizes (``bytes``) come from the first
    profile. On a machine whose speed shifts for seconds at a time, one profile catches one moment;
    profiles bracketing a run average over its span, as the run's median step does. The header is the
    first profile's, with a measured contention curve averaged pointwise and ``merged=<count>``.
    Raises ConfigError when the profiles do not hold the same rows."""
    if not profiles:
        raise ConfigError("no profiles to merge")
    keys = [sorted((r.layer_type, r.microbatch_size, r.kind) for r in rows) for rows, _ in profiles]
    for i, other in enumerate(keys[1:], start=2):
        if other != keys[0]:
            raise ConfigError(f"profile {i} does not measure the same rows as profile 1; cannot merge them")
    measured: dict[tuple[str, int, str], list[float]] = {}
    for rows, _ in profiles:
        for r in rows:
            times = measured.setdefault((r.layer_type, r.microbatch_size, r.kind), [])
            if r.seconds > 0:
                times.append(r.seconds)
    first_rows, first_meta = profiles[0]
    rows = []
    for r in first_rows:
        times = measured[(r.layer_type, r.microbatch_size, r.kind)]
        rows.append(
            ProfileRow(
                r.layer_type, r.microbatch_size, r.kind, sum(times) / len(times) if times else 0.0, r.bytes
            )
        )
    meta = {k: str(v) for k, v in first_meta.items()}
    curves = [str(m["contention"]).split(",") for _, m in profiles if m.get("contention")]
    if curves:
        if len(curves) != len(profiles) or len({len(c) for c in curves}) > 1:
            raise ConfigError(
                "the profiles' contention curves differ in length (or some have none); cannot merge them"
            )
        try:
            values = [[float(x) for x in c] for c in curves]
        except ValueError:
            raise ConfigError(f"bad contention curve in a profile: {curves}") from None
        meta["contention"] = ",".join(
            f"{sum(v[i] for v in values) / len(values):.4f}" for i in range(len(values[0]))
        )
    meta["merged"] = str(len(profiles))
    return tuple(rows), meta


@dataclass(frozen=True, eq=False)
class ProfiledCost:
    """:class:`~pipewright.cost.base.CostModel` from a measured table (format: module docstring).

    ``microbatch``: the microbatch size whose rows are used. ``layers``: the model's transformer layers,
    split over a schedule's stages by ``layout`` (counts or a Layout, which also places the embedding
    and output rows: :mod:`pipewright.cost.placement`; or uniformly). ``grad_bytes_per_param_byte``: the
    REDUCE_GRAD size as a fraction of a chunk's PARAMS bytes (default 1: PARAMS then means gradient bytes).
    """

    rows: tuple[ProfileRow, ...]
    microbatch: int
    layers: int
    layout: Sequence[int] | Layout | None = None
    grad_bytes_per_param_byte: float = 1.0
    meta: Mapping[str, str] = field(default_factory=dict)
    _table: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = sorted({r.microbatch_size for r in self.rows})
        if self.microbatch not in sizes:
            listed = ", ".join(map(str, sizes)) or "none"
            raise ConfigError(f"the profile has no microbatch size {self.microbatch}; measured: {listed}")
        for r in self.rows:
            if r.microbatch_size == self.microbatch:
                self._table[r.layer_type, r.kind] = (r.seconds, r.bytes)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, microbatch: int, layers: int, **kwargs: Any) -> ProfiledCost:
        """Read a profile CSV (``.csv``) or JSON (``.json``)."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc.strerror}") from None
        if str(path).endswith(".json"):
            rows, meta = cls.parse_json(text)
        else:
            rows, meta = read_profile_csv(text)
        return cls(rows, microbatch, layers, meta=meta, **kwargs)

    @staticmethod
    def parse_json(text: str) -> tuple[tuple[ProfileRow, ...], dict[str, str]]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile is not valid JSON: {exc.msg} (line {exc.lineno})") from None
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or not isinstance(data.get("rows"), list)
        ):
            raise ConfigError(f'not a profile: expected "format": "{FORMAT}" and a "rows" list')
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ConfigError('profile "meta" must be an object of key/value pairs')
        rows = tuple(_row(item, f"profile row {i}") for i, item in enumerate(data["rows"]))
        return rows, {str(k): str(v) for k, v in meta.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "meta": dict(self.meta),
            "rows": [asdict(r) for r in self.rows],
        }

    @classmethod
    def from_pipefisher(
        cls,
        model: str,
        gpu: str,
        bs: int,
        layers: int | None = None,
        directory: str | Path | None = None,
        **kwargs: Any,
    ) -> ProfiledCost:
        """PipeFisher's per-block profile ``<model>_time_memory_<gpu>.csv`` (Osawa et al., MLSys 2023; a
        copy ships in ``pipewright/cost/profiles/pipefisher``): time_f → F, time_b → B (I = W = B/2),
        time_kron/time_inv/time_prec → KFAC_KRON/KFAC_INV/KFAC_PREC, all ms → s; mem_act → F bytes,
        mem_param → PARAMS bytes (MiB → bytes). Only transformer blocks are profiled (no embedding or
        output rows). ``layers`` defaults to the model's block count."""
        name = f"{model}_time_memory_{gpu}.csv"
        if directory is None:
            source = resources.files("pipewright.cost").joinpath("profiles", "pipefisher", name)
        else:
            source = Path(directory) / name
        try:
            text = source.read_text()
        except (OSError, FileNotFoundError):
            models = ", ".join(PIPEFISHER_LAYERS)
            raise ConfigError(
                f"no PipeFisher profile for {model!r} on {gpu!r}; models: {models}; GPUs: p100, v100, rtx3090"
            ) from None
        rows: list[ProfileRow] = []
        for item in csv.DictReader(text.splitlines()):
            b = int(item["bs"])
            ms = {
                k: float(item[k]) / 1000 for k in ("time_f", "time_b", "time_kron", "time_inv", "time_prec")
            }
            rows += [
                ProfileRow("layer", b, F, ms["time_f"], float(item["mem_act"]) * MIB),
                ProfileRow("layer", b, B, ms["time_b"]),
                ProfileRow("layer", b, "KFAC_KRON", ms["time_kron"]),
                ProfileRow("layer", b, "KFAC_INV", ms["time_inv"]),
                ProfileRow("layer", b, "KFAC_PREC", ms["time_prec"]),
                ProfileRow("layer", b, PARAMS, 0.0, float(item["mem_param"]) * MIB),
            ]
        if layers is None:
            layers = PIPEFISHER_LAYERS.get(model, 1)
        meta = {"model": model, "device": gpu, "seq_len": "128", "source": "PipeFisher (Osawa et al. 2023)"}
        return cls(tuple(rows), bs, layers, meta=meta, **kwargs)

    # -- lookups -----------------------------------------------------------------------------------
    def time(self, layer_type: str, kind: str) -> float:
        """Seconds of ``kind`` for one ``layer_type`` at this microbatch size, gaps filled (docstring)."""
        hit = self._table.get((layer_type, kind))
        if hit is not None:
            return hit[0]
        if kind in (I, W) and (layer_type, B) in self._table:
            return self._table[layer_type, B][0] / 2
        if kind == B and (layer_type, I) in self._table:
            return self.time(layer_type, I) + self.time(layer_type, W)
        return 0.0

    def nbytes(self, layer_type: str, kind: str) -> float:
        return self._table.get((layer_type, kind), (0.0, 0.0))[1]

    def composition(self, stage: int, schedule: Schedule) -> dict[str, int]:
        """How many of each layer type chunk ``stage`` holds."""
        n = schedule.num_stages
        counts = layer_counts(self.layout, self.layers, n)
        embedding, head = roles(self.layout, stage, n)
        return {"embedding": int(embedding), "layer": counts[stage], "output": int(head)}

    def _sum(self, stage: int, schedule: Schedule, value: Callable[[str], float]) -> float:
        return sum(count * value(lt) for lt, count in self.composition(stage, schedule).items() if count)

    # -- CostModel ----------------------------------------------------------------------------------
    def compute_time(self, action: Action, schedule: Schedule) -> float:
        if not schedule.kinds[action.kind].compute:
            return 0.0
        if action.kind not in (F, B, I, W) and action.payload is not None:
            return self.time("layer", action.kind)
        return self._sum(action.stage, schedule, lambda lt: self.time(lt, action.kind))

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind in (SEND_F, RECV_F, SEND_B, RECV_B):
            return self.nbytes("layer", MESSAGE)
        if action.kind == REDUCE_GRAD:
            params = self._sum(action.stage, schedule, lambda lt: self.nbytes(lt, PARAMS))
            return params * self.grad_bytes_per_param_byte
        return 0.0

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind not in (F, B, I):
            return 0.0
        kept = self._sum(action.stage, schedule, lambda lt: self.nbytes(lt, F))
        return kept if action.kind == F else -kept

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return sum(
            self._sum(c, schedule, lambda lt: self.nbytes(lt, PARAMS)) for c in schedule.stages_of(rank)
        )

    def flops(self, action: Action, schedule: Schedule) -> float:
        """Not measured: 0 (a profile knows times, not FLOPs)."""
        return 0.0

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        return 0.0


@dataclass(frozen=True, eq=False)
class ProfiledComm:
    """:class:`~pipewright.cost.base.CommModel` from a profile's measured ``MESSAGE`` row: a message of
    the profiled size between two ranks takes the measured one-way time (``seconds``); a message of
    another size ``n`` takes it scaled by ``n / bytes``; collectives (REDUCE_GRAD) go to ``collectives``
    (e.g. ``TopologyComm(single_host(world), mesh)``), or cost 0."""

    seconds: float
    nbytes: float
    collectives: Any = None

    @classmethod
    def from_cost(cls, cost: ProfiledCost, collectives: Any = None) -> ProfiledComm:
        return cls(cost.time("layer", MESSAGE), cost.nbytes("layer", MESSAGE), collectives)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst or nbytes <= 0:
            return 0.0
        if self.nbytes <= 0 or nbytes == self.nbytes:
            return self.seconds
        return self.seconds * nbytes / self.nbytes

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        if self.collectives is None:
            return 0.0
        return self.collectives.collective_time(kind, rank, nbytes, group, members)


def load_profile(path: str | Path) -> tuple[tuple[ProfileRow, ...], dict[str, str]]:
    """Rows and header of a profile CSV or JSON file (one-line ConfigError when missing or malformed)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"profile {path} is a folder; give the profile file (.csv or .json) it holds")
    if not path.is_file():
        raise ConfigError(
            f"profile file {path} does not exist; write one with `pipewright profile --out {path}`"
        )
    from pipewright.files import naming, read_text

    text = read_text(path, "profile file")
    with naming(path, "profile"):
        rows, meta = (
            ProfiledCost.parse_json(text) if text.lstrip().startswith("{") else read_profile_csv(text)
        )
    check_complete(rows, str(path))
    return rows, meta


def check_complete(rows: Sequence[ProfileRow], where: str) -> None:
    """Every layer type with an F time and a backward (B, or I and W) at every microbatch size, and a
    positive layer F: a truncated or hand-cut profile would otherwise cost the missing passes 0 s."""
    sizes = sorted({r.microbatch_size for r in rows})
    if not sizes:
        raise ConfigError(f"profile {where} has no measurements; write one with `pipewright profile`")
    have = {(r.layer_type, r.microbatch_size, r.kind) for r in rows}
    for b in sizes:
        for layer in LAYER_TYPES:
            backward = (layer, b, B) in have or {(layer, b, I), (layer, b, W)} <= have
            missing = [k for k, ok in ((F, (layer, b, F) in have), ("B (or I and W)", backward)) if not ok]
            if missing:
                raise ConfigError(
                    f"profile {where} is incomplete: no {' or '.join(missing)} time for {layer} at "
                    f"microbatch size {b} (a truncated file?); measure again with `pipewright profile`"
                )
    times = {(r.layer_type, r.microbatch_size, r.kind): r.seconds for r in rows}
    for b in sizes:
        if not times.get(("layer", b, F), 0.0) > 0 or not (
            times.get(("layer", b, B), 0.0) > 0 or times.get(("layer", b, I), 0.0) > 0
        ):
            raise ConfigError(
                f"profile {where}: the layer's forward and backward times at microbatch size {b} must be "
                "positive (0 means not measured); measure again with `pipewright profile`"
            )
