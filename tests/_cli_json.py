"""Test helper: a command's ``--json`` report, run in this process through ``pipewright.cli.main``."""

from __future__ import annotations

import contextlib
import io
import json

from pipewright.cli import main


def cli_json(argv: list[str]) -> dict:
    """``pipewright ARGV --json``'s report (the command must exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())
