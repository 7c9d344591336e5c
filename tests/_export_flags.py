"""Megatron-LM's reading of exported flags, for the export tests."""

from __future__ import annotations


def megatron_flags(args: list[str]) -> dict[str, object]:
    """``--x-y V`` → x_y = V (int or float where it reads as one); a switch → True, ``--disable-x`` →
    x = False (Megatron-LM's ArgumentGroupFactory's rule for dataclass fields)."""
    out: dict[str, object] = {}
    i = 0
    while i < len(args):
        name = args[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value: object = args[i + 1]
            for kind in (int, float):
                try:
                    value = kind(args[i + 1])
                    break
                except ValueError:
                    pass
            out[name], i = value, i + 2
        elif name.startswith("disable_"):
            out[name.removeprefix("disable_")], i = False, i + 1
        else:
            out[name], i = True, i + 1
    return out
