"""Start-up of the command line: building a command's parser imports no numpy, torch or matplotlib (the
features declare their options in light modules; their hooks and plugins load when used), and a
``simulate`` run imports neither torch nor matplotlib. One fresh interpreter checks every case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("numpy", "torch", "matplotlib")

_PROBE = r"""
import contextlib, io, json, sys
from pipewright.cli import main

HEAVY = ("numpy", "torch", "matplotlib")


def heavy():
    return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))


out = {}
for argv in (["--help"], ["simulate", "--help"], ["plan", "--help"], ["train", "--help"],
             ["export-plan", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    out[" ".join(argv)] = heavy()
with contextlib.redirect_stdout(io.StringIO()) as text:
    code = main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--cost", "unit",
                 "--vocab-parallel", "alg1"])
out["simulate run"] = sorted(set(heavy()) - {"numpy"})  # the simulator computes with numpy
out["code"] = code
out["text"] = text.getvalue().splitlines()[0]
print(json.dumps(out))
"""


def test_parsers_and_the_simulate_path_import_no_numpy_torch_or_matplotlib() -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    out = json.loads(done.stdout.splitlines()[-1])
    assert out.pop("code") == 0
    assert out.pop("text") == "1f1b, cost unit, vocab parallel alg1, 1 iteration(s)"
    assert out == {
        "--help": [],
        "simulate --help": [],
        "plan --help": [],
        "train --help": [],
        "export-plan --help": [],
        "simulate run": [],
    }
