"""The simulated side of ``--optimizer kfac`` (PipeFisher's K-FAC in the bubbles): its memory per rank
and the bubble plan the measured program follows (the same tasks in the same bubbles as the
prediction: the runtime's fills by measured durations would move with the machine's load), as
``pipewright simulate --fill kfac`` prices them — one function,
:func:`pipewright.features.kfac.rank_memory.kfac_ranks`, over the schedule with a ``KFAC_FILL`` in
every bubble (the one ``train`` runs).

The peak is the rank's program-order memory (:func:`~pipewright.sim.memory.peak_from_deltas`, as the
simulator takes it) with K-FAC's bytes added at each action of the recording iteration; its factors
and inverses are static (``kfac_state``); what K-FAC still holds at the iteration's end (inputs and
gradients of tasks left for later bubbles, the preconditioned gradients) is there at the optimizer
step too."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipewright.features.kfac.rank_memory import KfacRank


def kfac_ranks(run, setup) -> dict[int, KfacRank]:
    """Per pipeline rank, K-FAC's memory and plan; {} unless the run trains with ``--optimizer kfac``
    a model whose covered layers are priced (:data:`~pipewright.features.kfac.curvature_memory.BLOCKS`)."""
    if run.config.optimizer != "kfac":
        return {}
    from pipewright.features.kfac.rank_memory import kfac_ranks as ranks

    return ranks(setup.cost, setup.schedule)
