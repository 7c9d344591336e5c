"""``pipewright simulate --vocab-parallel none|redistribute|naive|alg1|alg2`` (pure Python; the flag
is declared by :class:`.options.VocabOptions`).

:func:`apply_to_simulation` turns a simulation set-up (schedule, cost model, communication model) into
the chosen method's: ``redistribute`` re-lays the transformer layers (TransformerCost only);
``naive``/``alg1``/``alg2`` insert the vocabulary actions with :func:`~.insert.insert_vocab`, placed by
the same costs, and price them with :class:`~.cost.VocabCost` (or 1 per pass under ``--cost unit``;
the naive algorithm's S there is two halves, :func:`~.insert.unit_vocab_times`).
"""

from __future__ import annotations

from dataclasses import replace

from pipewright.cost.unit import UnitCost
from pipewright.errors import ConfigError
from pipewright.features.vocab.insert import PlacementCosts, insert_vocab, unit_vocab_times
from pipewright.features.vocab.kinds import COLLECTIVE_KINDS
from pipewright.features.vocab.options import CHOICES
from pipewright.ir import Action, Schedule


def placement_costs(cost, schedule: Schedule) -> PlacementCosts:
    """The insertion pass's durations from a cost model: compute on its rank; for a VocabCost also the
    collectives over the vocab group and one stage-boundary transfer (``simulate --vocab-parallel`` and
    :mod:`.experiment` both place by it)."""
    from pipewright.features.vocab.cost import VocabCost

    coll = {k: cost.collective_time(k) for k in COLLECTIVE_KINDS} if isinstance(cost, VocabCost) else {}
    p2p = 0.0
    if isinstance(cost, VocabCost) and schedule.num_ranks > 1:
        nbytes = cost.inner.message_bytes(Action(0, "SEND_F", 0), schedule)
        p2p = cost.inner.comm.p2p_time(0, 1, nbytes)
    probe = schedule.with_actions(schedule.actions, kinds=_kinds(schedule))
    return PlacementCosts(lambda a: cost.compute_time(a, probe), coll, p2p)


def _kinds(schedule: Schedule):
    from pipewright.features.vocab.kinds import registry

    return registry("alg2", schedule.kinds)


def apply_to_simulation(option: str, schedule: Schedule, cost, comm, *, unit: bool = False):
    """(schedule, cost, comm) for ``option``; unchanged for ``none``."""
    # the transformer and vocabulary cost models load only when a method is chosen (plain simulate runs
    # pass through simulate_hook without them)
    from pipewright.cost.transformer import TransformerCost
    from pipewright.features.vocab.cost import VocabComm, VocabCost, redistribute_layout

    if option not in CHOICES:
        raise ConfigError(f"--vocab-parallel {option!r}; choose one of {', '.join(CHOICES)}")
    if option == "none":
        return schedule, cost, comm
    if unit:
        if option == "redistribute":
            raise ConfigError("--vocab-parallel redistribute needs --model (unit costs have no layers)")
        if isinstance(cost, UnitCost):
            cost = replace(cost, times={**cost.times, **unit_vocab_times(option)})
        return insert_vocab(schedule, option, placement_costs(cost, schedule)), cost, comm
    from pipewright.sim.pair_overlap import PairOverlapCost, with_pair_overlap

    if isinstance(cost, PairOverlapCost):  # DualPipeV's F&B pairs: re-applied to the new cost below
        cost = cost.base
    if not isinstance(cost, TransformerCost):
        raise ConfigError("--vocab-parallel needs --model or --cost unit (a profile has no vocabulary costs)")
    spec, mesh = cost.spec, cost.mesh
    common = dict(
        microbatch=cost.microbatch,
        gpu=cost.gpu,
        dtype=cost.dtype,
        recompute=cost.recompute,
        mesh=mesh,
        topology=cost.topology,
        sequence_parallel=cost.sequence_parallel,
        efficiency=cost.efficiency,
        attention=cost.attention,
    )
    # the chosen costs keep every input of the user's cost model (its class, framework, sharding,
    # context parallelism, partial recomputation, ...): only the layout or the vocabulary changes
    if option == "redistribute":
        layout = redistribute_layout(spec, schedule, pp=mesh.pp, tp=mesh.tp, **_kw(common))
        new = replace(cost, layout=layout)
        return schedule, with_pair_overlap(new, schedule), new.comm
    inner = replace(cost, spec=replace(spec, vocab=0))
    vcost = VocabCost(spec, inner, option)
    sched = insert_vocab(schedule, option, placement_costs(vcost, schedule))
    return sched, vcost, VocabComm(vcost)


def _kw(common: dict) -> dict:
    return {k: v for k, v in common.items() if k != "mesh"}


def simulate_hook(request, setup):
    """``pipewright simulate --vocab-parallel``: the setup with the chosen method applied (``request``:
    the :class:`~pipewright.plan.request.SimulateRequest`)."""
    option = request.spec.features["vocab"].parallel
    if option == "none":
        return setup
    sched, cost, comm = apply_to_simulation(option, setup.schedule, setup.cost, setup.comm, unit=setup.unit)
    method = option if option == "redistribute" else f"parallel {option}"  # "vocab parallel naive"
    return replace(setup, schedule=sched, cost=cost, comm=comm, label=f"{setup.label}, vocab {method}")
