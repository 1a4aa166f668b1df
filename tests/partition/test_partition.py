"""Layer-list partition and the exact min-max balance."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import conveyor
from conveyor.partition import split_sequential


def brute_force(costs: list[int], stages: int) -> int:
    """The smallest possible largest-stage cost, by trying every cut."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_balance_beats_deepspeeds_heuristic_example() -> None:
    sizes = conveyor.balance([2, 8, 4, 5, 1, 8], 4)
    assert sizes == [1, 1, 2, 2]
    costs = [2, 8, 4, 5, 1, 8]
    bounds = list(itertools.accumulate([0, *sizes]))
    assert max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) == 9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.integers(1, 9))
def test_balance_is_optimal_and_complete(costs: list[int], stages: int) -> None:
    if stages > len(costs):
        with pytest.raises(conveyor.ConfigError, match="cannot split"):
            conveyor.balance(costs, stages)
        return
    sizes = conveyor.balance(costs, stages)
    assert len(sizes) == stages and sum(sizes) == len(costs) and min(sizes) >= 1
    bounds = list(itertools.accumulate([0, *sizes]))
    worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert worst == brute_force(costs, stages)


def test_balance_spreads_zero_cost_layers() -> None:
    assert conveyor.balance([0, 1, 0, 1, 0, 1, 0, 1], 2) == [4, 4]


def test_split_keeps_original_names_and_order() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    stages = split_sequential(model, 2, [3, 1])
    assert [n for n, _ in stages[0].named_parameters()] == ["1.weight", "1.bias"]
    assert [n for n, _ in stages[1].named_parameters()] == ["3.weight", "3.bias"]
    assert stages[1][0] is model[3]  # the same module objects: no copies


def test_default_split_balances_parameter_counts() -> None:
    widths = [(10, 10), (10, 10), (10, 100), (100, 1)]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in widths))
    stages = split_sequential(model, 2)
    assert [len(s) for s in stages] == [2, 2]  # 220 | 1201 beats 110 | 1311 and 1320 | 101


def test_split_of_a_module_list() -> None:
    layers = [nn.Linear(2, 2) for _ in range(4)]
    stages = split_sequential(layers, 4)
    assert [len(s) for s in stages] == [1, 1, 1, 1]


def test_the_split_says_how_it_was_made_and_what_each_stage_calls() -> None:
    from conveyor.partition.methods import called_modules

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    conveyor.init(pp=2)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    for model, method in ((layers, "layers"), (Two(), "fx"),
                          (conveyor.sequence(Two(), ["a", "b"]), "sequence")):  # fmt: skip
        pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=2)
        assert pipe.describe().method == method
        calls = [m for stage in pipe.stages for m in called_modules(stage)]
        assert [type(m) for m in calls if isinstance(m, nn.Linear)] == [nn.Linear] * 2, method
