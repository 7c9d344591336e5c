"""Running ``pipewright`` in-process on fuzzed files and paths (tests/test_fuzz_files.py,
tests/test_fuzz_paths.py): each call under a time bound, its exit status and stderr captured, and the
properties every case must keep — no traceback, no run past the bound, a one-line error and a non-zero
status for nonsense, every file under the case's folder unchanged and nothing new written there.

Also the malformed-document generators the readers' corpora are made of: a valid JSON document cut
short, given a byte that is not UTF-8, replaced by garbage or by a value of the wrong type, and with
each named field set to NaN, ±infinity, negative, zero, huge or a value of the wrong type, or removed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pipewright.cli import main

BOUND_S = 10.0
#: byte sequences that are not UTF-8 anywhere in a text
BAD_BYTES = (b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80")
#: whole documents of the wrong kind
WRONG_DOCUMENTS = ("", " ", "\n\n", "\ufeff", "null", "[]", "5", '"x"', "true", "[{}]", "{", "}")
NAN, INF = math.nan, math.inf
#: wrong values for a field holding a positive number
POSITIVE_BAD = (NAN, INF, -INF, -1, 0, -1e-9, "fast", None, True, [], {})
#: the same for a count (an integer), with a fraction
COUNT_BAD = (*POSITIVE_BAD, 1.5)
#: wrong values for a field holding a non-negative number (0 is fine)
NONNEGATIVE_BAD = (NAN, INF, -INF, -1, "fast", None, [], {})
STRING_BAD = (5, None, [], {}, True)
HUGE = 1e300


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout


@dataclass
class Outcome:
    code: int
    err: str
    seconds: float


def run(argv: list[str]) -> Outcome:
    """``pipewright argv`` in this process; ``Timeout`` past :data:`BOUND_S`."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(code, err.getvalue(), time.perf_counter() - start)


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) with the SHA-256 of its bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def refused(argv: list[str], root: Path, case: str) -> str | None:
    """Run ``argv``; None when it was refused as it must be (non-zero, a one-line error as the last
    line, no traceback, within the bound, ``root``'s files unchanged and none added), else why not."""
    before = digest(root)
    try:
        outcome = run(argv)
    except Timeout:
        return f"{case}: ran past {BOUND_S:g} s: {' '.join(argv)[:300]}"
    text = outcome.err.strip()
    after = digest(root)
    if "Traceback" in text:
        return f"{case}: traceback: {' '.join(argv)[:300]}\n{text[-1500:]}"
    if outcome.code == 0:
        return f"{case}: exit 0 on nonsense: {' '.join(argv)[:300]}"
    lines = text.splitlines()
    # the error is the last line, or the first of a schedule's ValidationError, whose grid follows
    last = next((line for line in lines if line.startswith("pipewright: error:")), lines[-1] if lines else "")
    grid = all(
        line.startswith(("step", "rank")) or not line.strip() for line in lines[lines.index(last) + 1 :]
    )
    if "error:" not in last or not grid:
        return f"{case}: exit {outcome.code} without a one-line error: {' '.join(argv)[:300]}\n{text[-800:]}"
    if len(last) > 1200:
        return f"{case}: an error line of {len(last)} characters: {last[:200]}…"
    if before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))[:4]
        return f"{case}: files changed or written under {root}: {changed}: {' '.join(argv)[:300]}"
    return None


def _set(doc, path: tuple, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _delete(doc, path: tuple) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


def json_corpus(
    doc: dict,
    fields: dict[tuple, tuple],
    required: tuple[tuple, ...],
    seed: int,
    *,
    cuts: int = 25,
    bad_bytes: int = 15,
    garbage: int = 10,
) -> list[tuple[str, bytes]]:
    """Malformed versions of the valid JSON ``doc`` (module docstring): (what, bytes)."""
    rng = random.Random(seed)
    text = json.dumps(doc, separators=(",", ":"))
    cases = [(f"cut at {k}", text[:k].encode()) for k in sorted(rng.sample(range(1, len(text) - 1), cuts))]
    for _ in range(bad_bytes):
        k = rng.randrange(len(text))
        cases.append((f"non-UTF-8 at {k}", text[:k].encode() + rng.choice(BAD_BYTES) + text[k:].encode()))
    for _ in range(garbage):
        cases.append(("garbage", b"\xff" + rng.randbytes(rng.randrange(0, 300))))
    cases += [(f"document {t!r}", t.encode()) for t in WRONG_DOCUMENTS]
    for path, values in fields.items():
        for value in values:
            bad = copy.deepcopy(doc)
            _set(bad, path, value)
            cases.append(
                (f"{'.'.join(map(str, path))}={value!r:.30}", json.dumps(bad, allow_nan=True).encode())
            )
    for path in required:
        bad = copy.deepcopy(doc)
        _delete(bad, path)
        cases.append((f"no {'.'.join(map(str, path))}", json.dumps(bad).encode()))
    return cases


def text_cuts(text: str, seed: int, count: int, end: int | None = None) -> list[tuple[str, bytes]]:
    """``text`` cut at ``count`` positions before ``end`` (default: its last character)."""
    rng = random.Random(seed)
    end = len(text) - 1 if end is None else end
    return [(f"cut at {k}", text[:k].encode()) for k in sorted(rng.sample(range(0, end), min(count, end)))]


def bytes_corpus(text: str, seed: int, count: int) -> list[tuple[str, bytes]]:
    """``text`` with a non-UTF-8 byte inserted, and garbage, ``count`` of each."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        k = rng.randrange(len(text))
        cases.append((f"non-UTF-8 at {k}", text[:k].encode() + rng.choice(BAD_BYTES) + text[k:].encode()))
        cases.append(("garbage", b"\xff" + rng.randbytes(rng.randrange(0, 300))))
    return cases
