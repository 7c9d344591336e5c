"""The cost models place the embedding and the output layer where the layout says (not by stage index)."""

from __future__ import annotations

import pytest

from pipewright.cost.comm import Mesh
from pipewright.cost.placement import layer_counts, loss_stage, roles
from pipewright.cost.transformer import TransformerCost
from pipewright.errors import ConfigError
from pipewright.ir import Action, F, W
from pipewright.models.layout import Layout, StageLayout, parse_layout
from pipewright.models.presets import get_preset
from pipewright.schedules import build_schedule


def _cost(layout) -> TransformerCost:
    return TransformerCost(get_preset("gpt3-xl"), microbatch=1, mesh=Mesh(pp=2), layout=layout)


def test_a_layout_string_and_layer_counts_cost_the_same() -> None:
    sched = build_schedule("1f1b", 2, 4)
    counts, layout = _cost((12, 12)), _cost(parse_layout("Et*12|t*12L"))
    for s in range(2):
        for kind in (F, W):
            a = Action(s, kind, 0)
            assert counts.compute_time(a, sched) == layout.compute_time(a, sched)
            assert counts.activation_bytes(a, sched) == layout.activation_bytes(a, sched)
        assert counts.static_bytes(s, sched) == layout.static_bytes(s, sched)


def test_stages_without_the_vocabulary_layers_cost_only_their_transformer_layers() -> None:
    sched = build_schedule("1f1b", 2, 4)
    bare = Layout(
        (StageLayout(False, tuple(range(12)), False), StageLayout(False, tuple(range(12, 24)), False))
    )
    cost, std = _cost(bare), _cost((12, 12))
    first, last = (cost.flops(Action(s, F, 0), sched) for s in (0, 1))
    assert first == last  # no logit layer on the last stage, no embedding on the first
    assert std.flops(Action(1, F, 0), sched) > last
    assert cost.static_bytes(0, sched) == cost.static_bytes(1, sched) < std.static_bytes(1, sched)
    assert loss_stage(bare, 2) is None and loss_stage(None, 3) == 2
    assert roles(bare, 0, 2) == (False, False) and roles(None, 0, 2) == (True, False)


def test_a_layout_that_does_not_fit_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="must give 3 stages summing to 24 layers"):
        layer_counts((12, 12), 24, 3)
