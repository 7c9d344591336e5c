"""A one-line progress bar on a terminal's stderr (``plan``'s candidates, ``calibrate``'s runs)."""

from __future__ import annotations

import sys


class Bar:
    """``bar(done, total)`` redraws "``what`` [#####    ]  40% of ``total`` ``unit``" when the percentage
    changes; nothing when disabled or stderr is not a terminal."""

    def __init__(self, enabled: bool, what: str = "planning", unit: str = "candidates") -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.what = what
        self.unit = unit
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        pct = 100 * done // max(total, 1)
        if pct != self.last:
            self.last = pct
            bar = "#" * (pct // 4)
            print(f"\r{self.what} [{bar:<25}] {pct:3d}% of {total} {self.unit}", end="", file=sys.stderr)
            if done >= total:
                print(file=sys.stderr)
