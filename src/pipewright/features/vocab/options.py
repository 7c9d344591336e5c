"""The vocabulary feature's options: ``--vocab-parallel`` of ``pipewright train`` (TOML ``[vocab]``)
and of ``pipewright simulate``, one declaration (pure Python).

Two words for two things: ``none`` is the naive *placement* (no vocabulary parallelism: embedding on the
first stage, output layer on the last); ``naive`` is the naive vocabulary-parallel *algorithm* (three
barriers). ``simulate`` also takes ``redistribute`` (fewer transformer layers on the first and last
stages, :mod:`.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.options import option

CHOICES = ("none", "redistribute", "naive", "alg1", "alg2")
TRAIN_CHOICES = ("none", "naive", "alg1", "alg2")
_ALGORITHMS = "naive (three barriers), alg1 (two) or alg2 (one), Yeung et al. 2024"
HELP = (
    "vocabulary layers: none (the naive placement: embedding on the first stage, output on the last), "
    "redistribute (fewer transformer layers on those stages), or split over all pipeline ranks with the "
    f"vocabulary-parallel algorithm {_ALGORITHMS}"
)


@dataclass(frozen=True)
class VocabOptions:
    """The feature's options (TOML ``[vocab]``; ``--vocab-parallel`` on ``train`` and ``simulate``)."""

    parallel: str = option(
        "none",
        "--vocab-parallel",
        f"vocabulary layers split over all pipeline (and tensor) ranks: {_ALGORITHMS}; none: the naive "
        "placement",
        choices=TRAIN_CHOICES,
        commands=("train", "simulate"),
        variants={"simulate": {"choices": CHOICES, "help": HELP}},
    )
