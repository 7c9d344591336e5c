"""The real program of every distinct rank measured at full size without a GPU, against the simulator
(``pipewright train --dry-run --measure``).

:func:`measure_run` prepares the run (every check ``train`` makes but the size of this machine), asks
the simulator for the same layout (:mod:`.simulated`), then builds each distinct rank's stages on meta
tensors and a fake process group and runs one training step of the real executor with the real schedule
(:mod:`.rank`, :mod:`.tracker`), and compares the two (:mod:`.report`). Nothing is written.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from pipewright.measure.rank import RankMeasure, distinct_ranks, measure_rank
from pipewright.measure.side_by_side import RankComparison, compare, text

__all__ = ["MAX_DEVICES", "RankComparison", "RankMeasure", "compare", "distinct_ranks", "measure_run", "text"]

#: the most devices a measured layout may have: the simulated side builds a cluster of them and the
#: fake process group a mesh of them (32,768: about 10 s here; twice the 16,384 GPUs of Llama 3 405B)
MAX_DEVICES = 1 << 15


def measure_run(
    config,
    pp_ranks: Sequence[int] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[RankComparison]:
    """Measure the distinct ranks of ``config`` (``pp_ranks``: only these pipeline ranks; default all)
    and compare each with the simulator's prediction of its pipeline rank."""
    from pipewright.errors import ConfigError
    from pipewright.measure.simulated_side import predict
    from pipewright.training import prepare

    if getattr(config, "init_from", None):
        raise ConfigError("--measure builds no weights (meta tensors): drop --init-from")
    if config.world_size > MAX_DEVICES:
        raise ConfigError(
            f"--measure: {config.world_size:,} processes (tp × cp × pp × dp) is more than the "
            f"{MAX_DEVICES:,} devices the simulated side builds a cluster of; use fewer"
        )
    # the F&B pairs of an expert- or context-parallel run one after the other: the overlapped pair's
    # second thread would run outside the tracker, whose dispatch mode is the measuring thread's
    config = config.with_overrides(blocking_pairs=True)
    run = prepare(config, world_size=config.world_size, check_size=False)
    predicted = predict(run)
    ranks = distinct_ranks(run.config)
    chosen = range(len(ranks)) if pp_ranks is None else pp_ranks
    bad = [p for p in chosen if not 0 <= p < len(ranks)]
    if bad:
        raise ConfigError(f"--measure-ranks {bad[0]}: pipeline ranks are 0..{len(ranks) - 1}")
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fake backend's "timeout not supported" and the like
        for p in chosen:
            if progress is not None:
                progress(f"measuring pipeline rank {p} (global rank {ranks[p]})")
            out.append(compare(_measured(run, ranks[p], predicted[p].plan), predicted[p]))
    return out


def _measured(run, rank: int, plan=None):
    """:func:`measure_rank`, a failure of the model's code on meta tensors as a one-line ConfigError."""
    from pipewright.errors import ConfigError, PipewrightError

    try:
        return measure_rank(run, rank, plan)
    except PipewrightError:
        raise
    except Exception as exc:  # e.g. a model that reads values or copies weights to the host
        cause = exc.__cause__ or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise ConfigError(
            f"rank {rank}'s program cannot run on meta tensors ({type(cause).__name__}: {first[:200]}); "
            "--measure needs model code that computes no values from data"
        ) from exc
