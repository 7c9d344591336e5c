"""``--zb-refine`` and ``--zb-ilp-time-limit`` (the run spec's ``schedule`` section) read as the time
limit of the refinement of zb-auto's order by integer linear programming
(:mod:`pipewright.schedules.zb_ilp`), for ``schedule``, ``simulate`` and ``plan``."""

from __future__ import annotations

import math
from typing import Protocol

from pipewright.errors import ConfigError

#: seconds of solving when only --zb-refine is given
DEFAULT_SECONDS = 10.0


class Refinement(Protocol):
    """What holds the two settings: the RunSpec's ``schedule`` section."""

    zb_refine: bool
    zb_ilp_time_limit: float | None


def refine_seconds(section: Refinement, schedules: tuple[str, ...]) -> float | None:
    """The refinement's time limit from the settings (None: no refinement). ``schedules``: the
    schedules the command builds; refining asks for zb-auto among them. One-line ConfigError
    otherwise."""
    seconds = section.zb_ilp_time_limit
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"--zb-ilp-time-limit must be positive (got {seconds:g})")
    if not section.zb_refine and seconds is None:
        return None
    if "zb-auto" not in schedules:
        flag = "--zb-refine" if section.zb_refine else "--zb-ilp-time-limit"
        raise ConfigError(f"{flag} refines zb-auto only (got {', '.join(schedules)}); drop it or use zb-auto")
    return DEFAULT_SECONDS if seconds is None else seconds


def ilp_line(report: dict) -> str:
    """One line on what the refinement did (a schedule's ``meta["ilp"]``)."""
    start, result = report["start"][-1], report["result"][-1]
    if result < start:
        verdict = f"{start:g} → {result:g}"
    elif report.get("proven"):
        verdict = "the heuristic's order is optimal"
    else:
        verdict = "kept the heuristic's order (nothing faster found)"
    return (
        f"ILP refinement: {verdict} (estimated makespan; {report['solves']} solves, {report['seconds']:g} s)"
    )
