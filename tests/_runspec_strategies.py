"""Hypothesis strategies for RunSpecs: a random valid spec of one command (every field that command
takes drawn from its type, the others at the command's defaults)."""

from __future__ import annotations

import typing

from hypothesis import strategies as st

from pipewright.runspec import defaults, with_values
from pipewright.runspec.fields import base_type, choices, setting
from pipewright.runspec.flags import switch_clears
from pipewright.runspec.run import feature_sections, field_command, field_default, field_takes, spec_fields
from pipewright.runspec.validation import EXCLUSIVE

#: Any text but "--", which argparse takes for the end of the options even after "=".
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12).filter(
    lambda t: t != "--"
)


def _values(path, f, kind, command):
    start = field_default(path, f, command)
    floor = f.metadata.get("minimum") or 0
    base = base_type(kind)
    listed = setting(f, field_command(path, command), "choices") or choices(kind)
    if base is bool:
        drawn = st.sampled_from(sorted({start, not switch_clears(path, f.metadata["flag"])}))
    elif listed:
        drawn = st.sampled_from(tuple(listed))
    elif base == bool | str:
        drawn = st.one_of(st.booleans(), _TEXT)
    elif typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        one = st.integers(floor, 2**20) if item is int else _TEXT.filter(lambda t: "," not in t)
        drawn = st.lists(one, min_size=1, max_size=4).map(tuple)
    elif base is int:
        drawn = st.integers(floor, 2**40)
    elif base is float:
        drawn = st.floats(floor, 1e12, allow_nan=False, allow_infinity=False)
    else:
        drawn = _TEXT
    if path == ("parallelism", "layout"):
        drawn = st.sampled_from(["E|(t|)*2L", "Et*3|tmL", "(Et|)*1tt|t*4L"])
    return st.one_of(st.just(start), drawn)


@st.composite
def specs(draw, command: str):
    """A valid RunSpec of ``command``: its fields drawn, the rest at its defaults."""
    features = feature_sections()
    changes = {
        path: draw(_values(path, f, kind, command), label=".".join(path))
        for path, f, kind in spec_fields(features)
        if field_takes(path, f, command)
    }
    for a, b in EXCLUSIVE:  # the pairs (dict keys)
        if changes.get(a) and changes.get(b):
            changes[b] = False
    if changes.get(("parallelism", "layout")):  # a layout that fits whatever pp and layers were drawn
        for path in (("parallelism", "virtual"), ("model", "layers"), ("model", "mtp_depth")):
            changes[path] = None
    return with_values(defaults(command, features), changes)
