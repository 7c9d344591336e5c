"""``pipewright train --dry-run --measure`` and ``pipewright check --measure``: each distinct rank's
real program at full size on meta tensors, next to the simulator (:mod:`pipewright.measure`). Prints;
writes nothing."""

from __future__ import annotations

import argparse
import json


def measure(config, args: argparse.Namespace) -> int:
    """Measure and print (text, or JSON with ``--measure-json``)."""
    from pipewright.errors import ConfigError
    from pipewright.measure import measure_run, text

    if not getattr(args, "dry_run", True):  # train: only with --dry-run (check trains nothing here)
        raise ConfigError("--measure runs no training; add --dry-run")
    quiet = args.measure_json or not config.progress
    comparisons = measure_run(
        config, args.measure_ranks, progress=None if quiet else (lambda line: print(line, flush=True))
    )
    if args.measure_json:
        print(json.dumps([c.as_dict() for c in comparisons], indent=2))
    else:
        print(text(comparisons))
    return 0
