"""The JSON form of a topology (schema in :mod:`pipewright.topology`): parse, serialise, read a file."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipewright.errors import ConfigError, PipewrightError
from pipewright.hardware import accelerator, link
from pipewright.topology.elements import Edge, Node

FORMAT = "pipewright-topology"


def to_json(name: str, nodes: Iterable[Node], edges: Iterable[Edge]) -> dict[str, Any]:
    """The JSON object of a topology named ``name`` with these nodes and links."""
    return {
        "format": FORMAT,
        "version": 1,
        "name": name,
        "nodes": [
            {"name": n.name, "type": "device" if n.is_device else "switch", "host": n.host}
            | ({"accelerator": n.accelerator} if n.is_device else {})
            for n in nodes
        ],
        "links": [
            {"a": e.a, "b": e.b, "kind": e.kind, "bandwidth": e.bandwidth, "latency": e.latency}
            for e in edges
        ],
    }


def parse(data: Mapping[str, Any]) -> tuple[list[Node], list[Edge], str]:
    """(nodes, links, name) from the schema in the :mod:`pipewright.topology` docstring; one-line
    PipewrightError on bad input."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise PipewrightError(f'not a topology file: expected "format": "{FORMAT}"')
    name = data.get("name", "topology")
    if not isinstance(name, str):
        raise PipewrightError('topology "name" must be a string')
    nodes = []
    for i, item in enumerate(_list(data, "nodes")):
        _strings(item, f"topology node {i}", ("name", "type", "accelerator", "host"))
        kind = item.get("type", "device")
        acc = item.get("accelerator")
        if kind not in ("device", "switch") or "name" not in item:
            raise PipewrightError(f'topology node {i}: needs a name and type "device" or "switch"')
        if kind == "device":
            if acc is None:
                raise PipewrightError(f"topology device {item['name']!r} needs an accelerator")
            accelerator(str(acc))  # one-line error on an unknown kind
        host = item.get("host")
        nodes.append(
            Node(
                str(item["name"]),
                str(acc) if kind == "device" else None,
                None if host is None else str(host),
            )
        )
    edges = []
    for i, item in enumerate(_list(data, "links")):
        _strings(item, f"topology link {i}", ("a", "b", "kind"))
        try:
            a, b, kind = str(item["a"]), str(item["b"]), str(item["kind"])
        except (KeyError, TypeError):
            raise PipewrightError(f'topology link {i}: needs "a", "b" and "kind"') from None
        if "bandwidth" in item and "latency" in item:
            bw, lat = item["bandwidth"], item["latency"]
        else:
            spec = link(kind)
            bw, lat = item.get("bandwidth", spec.bandwidth), item.get("latency", spec.latency)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (bw, lat)):
            raise PipewrightError(f"topology link {i}: bandwidth and latency must be numbers")
        if not (0 < bw < 1e300 and 0 <= lat < 1e300):  # also NaN, inf and ints past float
            raise PipewrightError(
                f"topology link {i}: bandwidth must be positive and latency 0 or more, both finite"
            )
        edges.append(Edge(a, b, kind, float(bw), float(lat)))
    return nodes, edges, name


def save(data: Mapping[str, Any], path: str | Path) -> None:
    """``data`` as indented JSON (a topology file; plan files are written the same way)."""
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read(path: str | Path, what: str = "topology") -> Any:
    """The parsed JSON of a ``what`` file (a topology, a plan); one-line ConfigError when missing,
    unreadable, not UTF-8 or not JSON."""
    from pipewright.files import read_text

    try:
        data = json.loads(read_text(path, what))  # one line for a non-UTF-8 file too
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    return data


def _strings(item: Mapping[str, Any], where: str, keys: Sequence[str]) -> None:
    """Each of ``keys`` present in ``item`` is a string (``host`` may be null)."""
    for key in keys:
        value = item.get(key)
        if value is not None and not isinstance(value, str):
            raise PipewrightError(f'{where}: "{key}" must be a string, not {type(value).__name__}')


def _list(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
        raise PipewrightError(f'topology "{key}" must be a list of objects')
    return items
