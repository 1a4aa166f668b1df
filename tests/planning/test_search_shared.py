"""What a search shares among layouts alike gives what computing it afresh gives: the
memory walk kept per schedule and stages (:func:`conveyor.planning.memory.activation_peaks`),
and the cut into stages shared among costs that time their units alike."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from conveyor.planning.cluster import unit_balance
from conveyor.planning.costs import LAYER, UnitCost
from conveyor.planning.counting import count_model
from conveyor.planning.devices import hardware
from conveyor.planning.memory import activation_peaks
from conveyor.planning.predictor import Predictor
from conveyor.planning.search import layouts
from conveyor.schedules import get_schedule
from tests.planning.test_search_fast import llama


def _unit(i: int, kept: float) -> UnitCost:
    return UnitCost(
        name=f"unit {i}",
        forward=1.0,
        forward_plain=1.0,
        backward_input=1.0,
        backward_weight=1.0,
        backward=2.0,
        activations=kept,
        parameters=8.0,
        output=1.0,
        kind=LAYER,
        input=kept / 4,
        w_inputs=kept / 2,
    )


def test_the_memory_walk_kept_is_the_walk_afresh() -> None:
    schedule = get_schedule("zb-h1", 3, 6)
    parts = [[_unit(0, 3.0)], [_unit(1, 5.0), _unit(2, 1.0)], [_unit(3, 2.0)]]
    first = activation_peaks(schedule, parts, False, True)
    again = activation_peaks(schedule, parts, False, True)
    assert again == first and again is not first
    again[0] = -1.0  # the caller's copy
    assert activation_peaks(schedule, parts, False, True) == first
    # The same walk on an equal schedule (another object) and another walk per stages,
    # recompute and split: none takes another's peaks.
    assert activation_peaks(dataclasses.replace(schedule), parts, False, True) == first
    heavier = [[_unit(0, 30.0)], parts[1], parts[2]]
    assert activation_peaks(schedule, heavier, False, True)[0] > first[0]
    assert activation_peaks(schedule, parts, True, True) != first
    assert activation_peaks(schedule, parts, False, False) != first


def test_a_shared_cut_is_the_cut_of_those_costs() -> None:
    counted = count_model(llama(), 1024, "bf16")
    hw = hardware("a100-80g")
    predictor = Predictor(counted, hw)
    checked = 0
    for layout in layouts(counted, hw, 8, 1024, 16, "bf16"):
        costs = predictor.costed(layout)
        if costs is None:
            continue
        fresh = unit_balance(layout, len(counted.layers), costs.times(True))
        assert predictor.balance(layout, costs) == fresh, layout
        checked += 1
    assert checked > 200
    assert len(predictor.cuts) < len(predictor.balances)  # some shared
