"""Megatron-Core's pipeline-layout language (``--pipeline-model-parallel-layout``): read with repetition
expanded, and written back with repetition found.

The language, as ``megatron.core.transformer.pipeline_parallel_layer_layout`` (megatron-core 0.16)
reads it: ``|`` separates stages (pipeline ranks × virtual chunks, in layer order); a stage is a string
of layer symbols, ``E`` the embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-
prediction layer, ``L`` the output layer and its loss; ``X*N`` repeats one symbol (or one ``|``) N times
(N ≥ 0); ``(…)*N`` repeats a parenthesised piece, which may hold ``|`` and ``X*N`` but no parentheses;
commas are cosmetic and dropped before anything else (so ``t*1,2`` is ``t*12``). ``E|(t|)*126L`` is
``E``, 126 stages of one ``t``, then ``L``. Spaces are dropped too (Megatron-Core refuses them).

:func:`expand_layout` gives one symbol string per stage, as Megatron-Core's ``parse_str_to_list`` does
(tests/test_layout_text.py compares the two on generated layouts); text Megatron-Core reads only by the
accident of its regular expressions (``(t)*2*3``: a second repeat of the first's last symbol; nested
parentheses) is refused with a one-line error naming the character. :func:`format_layout` writes the
shortest text this module's search finds: runs of a symbol as ``tt`` or ``t*N`` (N > 3), runs of a
block of stages as ``(…|)*N``.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipewright.errors import ConfigError

#: The layer symbols, in the order they sit within a stage.
SYMBOLS = "EtmL"
#: The most symbols an expansion may hold (a typo such as ``t*10000000000`` is refused, not built).
MAX_SYMBOLS = 1_000_000
_DIGITS = "0123456789"


class _Reader:
    """A cursor over the text without commas and spaces, each character with its column (1-based) in
    the original text, for errors that name where the problem is."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.chars = [(c, i + 1) for i, c in enumerate(text) if c not in ", \t"]
        self.pos = 0

    def peek(self) -> str:
        return self.chars[self.pos][0] if self.pos < len(self.chars) else ""

    def column(self) -> int:
        return self.chars[self.pos][1] if self.pos < len(self.chars) else len(self.text) + 1

    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"layout {self.text!r}, column {self.column()}: {what}")

    def count(self) -> int | None:
        """The N of a ``*N`` at the cursor (consumed), or None when no ``*`` follows."""
        if self.peek() != "*":
            return None
        self.pos += 1
        start = self.pos
        while self.peek() and self.peek() in _DIGITS:
            self.pos += 1
        if self.pos == start:
            raise self.fail("'*' needs a repeat count (digits)")
        if self.peek() == "*":
            raise self.fail("one repeat per symbol or group; write the product")
        return int("".join(c for c, _ in self.chars[start : self.pos]))


def _atoms(reader: _Reader, inside: bool) -> list[tuple[str, int]]:
    """Symbols and ``|`` with their columns, repeats expanded, up to the end (or the ``)`` that closes
    the group when ``inside``)."""
    out: list[tuple[str, int]] = []
    while reader.peek() and not (inside and reader.peek() == ")"):
        c, col = reader.peek(), reader.column()
        if c == "(":
            if inside:
                raise reader.fail("parentheses do not nest in Megatron-Core's layout language")
            reader.pos += 1
            start = reader.pos
            body = _atoms(reader, inside=True)
            if reader.peek() != ")":
                raise reader.fail("'(' is not closed")
            if reader.pos == start:
                raise reader.fail("empty parentheses")
            reader.pos += 1
            n = reader.count()
            if n is None:
                raise reader.fail("a parenthesised group needs a repeat count '*N'")
            _check_size(reader, len(out) + len(body) * n)
            out.extend(body * n)
        elif c in SYMBOLS or c == "|":
            reader.pos += 1
            n = 1 if (n := reader.count()) is None else n
            _check_size(reader, len(out) + n)
            out.extend([(c, col)] * n)
        else:
            what = "')' without '('" if c == ")" else f"{c!r}"
            raise reader.fail(f"cannot read {what}; use E, t, m, L, '|', '*N' and '(…)*N'")
    return out


def _check_size(reader: _Reader, size: int) -> None:
    if size > MAX_SYMBOLS:
        raise ConfigError(f"layout {reader.text!r} expands to more than {MAX_SYMBOLS:,} symbols")


def expand_positions(text: str) -> list[list[tuple[str, int]]]:
    """Each stage's symbols with the column (1-based) of the character that wrote them."""
    reader = _Reader(text)
    stages: list[list[tuple[str, int]]] = [[]]
    for symbol, col in _atoms(reader, inside=False):
        if symbol == "|":
            stages.append([])
        else:
            stages[-1].append((symbol, col))
    return stages


def expand_layout(text: str) -> tuple[str, ...]:
    """One string of layer symbols per stage (``"E|(t|)*2L"`` → ``("E", "t", "tL")``); empty stages
    are kept, as Megatron-Core keeps them. One-line ConfigError naming the column otherwise."""
    return tuple("".join(s for s, _ in stage) for stage in expand_positions(text))


def _run(symbol: str, n: int) -> str:
    """n symbols, the shorter way: ``tt`` for 2, ``t*4`` for 4 (``ttt`` for 3, as long as ``t*3``)."""
    return "" if n == 0 else symbol * n if n <= 3 else f"{symbol}*{n}"


def format_stage(stage: str) -> str:
    """A stage's symbols with each run of one symbol written compactly (``Etttt`` → ``Et*4``)."""
    out, i = [], 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        out.append(_run(stage[i], j - i))
        i = j
    return "".join(out)


def format_layout(stages: Sequence[str]) -> str:
    """Short text for a layout given as one symbol string per stage: each stage by
    :func:`format_stage`, and a run of r ≥ 2 repeats of a block of stages written ``(a|b|)*r``.

    Dynamic programming over the stages: ``best[i]``, the text of stages i…k−1, is the shorter of
    stage i, ``|``, ``best[i+1]`` and, for every period p whose block repeats from stage i, the
    longest run of it that ends before the last stage (the group's trailing ``|`` needs a stage
    after it), ``(block|)*r`` then ``best[i+p·r]``. Repeats are found with ``same[p][j]``, the number of
    stages from j on that equal the stage p later: O(k²) for k stages."""
    texts = [format_stage(s) for s in stages]
    k = len(texts)
    if k == 0:
        raise ConfigError("a layout has at least one stage")
    first: dict[str, int] = {}
    ids = [first.setdefault(t, len(first)) for t in texts]
    chars = [0]  # chars[j]: the length of texts[:j], each with its "|"
    for t in texts:
        chars.append(chars[-1] + len(t) + 1)
    same = [[0] * (k + 1) for _ in range(k // 2 + 1)]
    for p in range(1, k // 2 + 1):
        for j in range(k - p - 1, -1, -1):
            same[p][j] = same[p][j + 1] + 1 if ids[j] == ids[j + p] else 0
    size = [0] * k
    choice: list[tuple[int, int]] = [(0, 0)] * k  # (p, r); p = 0: the stage written alone
    size[k - 1] = len(texts[k - 1])
    for i in range(k - 2, -1, -1):
        size[i], choice[i] = len(texts[i]) + 1 + size[i + 1], (0, 0)
        for p in range(1, (k - 1 - i) // 2 + 1):
            r = min(same[p][i] // p + 1, (k - 1 - i) // p)
            if r < 2:
                continue
            cost = chars[i + p] - chars[i] + 3 + len(str(r)) + size[i + r * p]
            if cost < size[i]:
                size[i], choice[i] = cost, (p, r)
    out, i = [], 0
    while i < k - 1:
        p, r = choice[i]
        if p == 0:
            out.append(texts[i] + "|")
            i += 1
        else:
            out.append("(" + "".join(t + "|" for t in texts[i : i + p]) + f")*{r}")
            i += p * r
    return "".join(out) + texts[k - 1]
