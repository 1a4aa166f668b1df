"""One search's predictions: :class:`Predictor` predicts the layouts of one counted model
on one hardware, sharing what layouts alike share (costs, cuts into stages, schedules,
simulations), and gives each layout's lower bounds from the cheapest to the tightest
(:meth:`Predictor.rung`), for :func:`~conveyor.planning.search.best_layouts`' branch and
bound.
"""

from __future__ import annotations

from dataclasses import replace

from conveyor.errors import ConfigError
from conveyor.planning.bounds import memory_bound, step_bound, work_bound
from conveyor.planning.cluster import GB, Estimate, layout_schedule, predict_layout, unit_balance
from conveyor.planning.costs import Costs
from conveyor.planning.counted import CountedSync, counted_costs, tp_buffer
from conveyor.planning.devices import Hardware
from conveyor.planning.layout import Layout
from conveyor.planning.memory import w_share
from conveyor.planning.model_count import ModelCount
from conveyor.planning.prediction import peaks, shares_of
from conveyor.schedules import Schedule
from conveyor.simulate import SimResult


class Predictor:
    """Predicts layouts of one count, sharing schedules and simulations among them."""

    def __init__(self, counted: ModelCount, hw: Hardware) -> None:
        self.counted, self.hw = counted, hw
        self.schedules: dict[tuple[str, int, int, int, float], Schedule | None] = {}
        self.sims: dict[object, SimResult] = {}
        self.costs: dict[tuple[object, ...], Costs | None] = {}
        self.balances: dict[tuple[int, int], list[int]] = {}
        self.cuts: dict[tuple[tuple[float, ...], int], list[int]] = {}  # time_balance's
        self.works: dict[tuple[int, str], float] = {}  # work bounds, shared
        self.cut_bounds: dict[tuple[int, str, int], float] = {}  # rung 0, shared
        self.tail_bounds: dict[Layout, float] = {}  # rung 1, shared
        # Each layout's predicted step. A recomputing layout runs its twin's schedule on
        # its twin's stages, with no action shorter and some Bs longer (the forward
        # again): its simulated step is no shorter, so the twin's step bounds it.
        self.steps: dict[Layout, float] = {}

    def costed(self, layout: Layout) -> Costs | None:
        """The layout's units, costed (None: a tp or cp that splits no heads evenly)."""
        # Within one search the units' costs depend on these alone (not on the schedule,
        # recompute or FSDP gathered once per step): costed once for the layouts alike.
        shape = (layout.pp, layout.tp, layout.cp, layout.dp, layout.ep, layout.microbatch_size)
        alike = (*shape, layout.microbatches, layout.fsdp == "reshard")
        if alike not in self.costs:
            try:
                self.costs[alike] = counted_costs(self.counted, self.hw, layout)
            except ConfigError:
                self.costs[alike] = None
        return self.costs[alike]

    def bounds(self, layout: Layout) -> tuple[float, float] | None:
        """Lower bounds on the layout's (step seconds, GB of its fullest rank), or None
        for a layout that cannot be costed."""
        costs = self.costed(layout)
        if costs is None:
            return None
        return step_bound(costs, self.balance(layout, costs), layout), self.memory_bound(layout)

    def balance(self, layout: Layout, costs: Costs) -> list[int]:
        """The layout's units per stage, cut once for the layouts alike."""
        key = (id(costs), layout.pp * layout.chunks)
        if key not in self.balances:
            times = costs.times(True)
            cut = (tuple(times), key[1])  # costs of other meshes often time their units alike
            if layout.balance is not None:
                self.balances[key] = unit_balance(layout, len(self.counted.layers), times)
            else:
                if cut not in self.cuts:
                    self.cuts[cut] = unit_balance(layout, len(self.counted.layers), times)
                self.balances[key] = self.cuts[cut]
        return self.balances[key]

    def memory_bound(self, layout: Layout) -> float:
        """:func:`~conveyor.planning.bounds.memory_bound`, for a layout that can be costed."""
        costs = self.costed(layout)
        assert costs is not None
        setting = layout.setting(tp_buffer(self.counted, layout))
        return memory_bound(costs, self.balance(layout, costs), layout, setting)

    def work(self, layout: Layout) -> float | None:
        """:func:`~conveyor.planning.bounds.work_bound` (None: a layout that cannot be
        costed)."""
        costs = self.costed(layout)
        if costs is None:
            return None
        key = (id(costs), layout.schedule)
        if key not in self.works:
            self.works[key] = work_bound(costs, layout)
        return self.works[key]

    def rung(self, layout: Layout, rung: int) -> tuple[float, float] | None:
        """The layout's lower bounds number ``rung`` on (step seconds, GB), from the
        cheapest: each step bound tighter than :meth:`work` and those before it (None:
        none left; 0: none known). 0: the cut's :func:`~conveyor.planning.bounds.step_bound`
        (None for a layout that cannot be costed), 1: :meth:`tail_bound`; for a layout
        that recomputes, 2: its twin's predicted step (never faster than without:
        :attr:`steps`) and 3: the forwards its schedule runs again (which builds the
        schedule); then :meth:`memory_bound` (0 s)."""
        costs = self.costed(layout)
        if costs is None:
            return None
        again = layout.recompute is True
        if rung == 0:  # the same for every FSDP and recompute of a schedule on these costs
            key = (id(costs), layout.schedule, layout.chunks)
            if key not in self.cut_bounds:
                self.cut_bounds[key] = step_bound(costs, self.balance(layout, costs), layout)
            return self.cut_bounds[key], 0.0
        if rung == 1:  # the same with recompute or without
            twin = replace(layout, recompute=False)
            if twin not in self.tail_bounds:
                self.tail_bounds[twin] = self.tail_bound(twin)
            return self.tail_bounds[twin], 0.0
        if again and rung == 2:
            return self.steps.get(replace(layout, recompute=False), 0.0), 0.0
        if again and rung == 3:
            return self.tail_bound(layout, recomputed=True), 0.0
        if rung == (4 if again else 2):
            return 0.0, self.memory_bound(layout)
        return None

    def tail_bound(self, layout: Layout, recomputed: bool = False) -> float:
        """:func:`~conveyor.planning.bounds.step_bound` with the tail and, ``recomputed``
        for a layout that recomputes, the forwards its schedule runs again; for a layout
        that can be costed."""
        costs = self.costed(layout)
        assert costs is not None
        balance = self.balance(layout, costs)
        again = None
        if recomputed and (schedule := self.schedule(layout, costs)) is not None:
            again = shares_of(schedule)
        return step_bound(costs, balance, layout, CountedSync(self.hw, layout), again)

    def memory_gb(self, layout: Layout) -> float | None:
        """The layout's :attr:`~conveyor.planning.cluster.Estimate.memory_gb` without
        simulating it (None: it cannot be costed, or its schedule cannot run)."""
        costs = self.costed(layout)
        schedule = None if costs is None else self.schedule(layout, costs)
        if costs is None or schedule is None:
            return None
        balance = self.balance(layout, costs)
        setting = layout.setting(tp_buffer(self.counted, layout))
        return max(peaks(schedule, costs, balance, setting)) / GB

    def schedule(self, layout: Layout, costs: Costs) -> Schedule | None:
        """The layout's schedule, built once for the layouts alike (None: too few
        micro-batches for it)."""
        # zb-auto fitted to what the model holds from B until W (uniform costs: shared)
        share = round(w_share([list(costs.layers)]), 2) if layout.schedule == "zb-auto" else 1.0
        key = (layout.schedule, layout.pp, layout.microbatches, layout.chunks, share)
        if key not in self.schedules:
            try:
                self.schedules[key] = layout_schedule(layout, [], 0.0, share)
            except ConfigError:  # too few micro-batches for this schedule
                self.schedules[key] = None
        return self.schedules[key]

    def predict(self, layout: Layout) -> Estimate | None:
        """The layout's :class:`~conveyor.planning.cluster.Estimate` (None: it cannot be
        costed, or its schedule cannot run its micro-batches)."""
        costs = self.costed(layout)
        if costs is None:
            return None
        schedule = self.schedule(layout, costs)
        if schedule is None:
            return None
        try:
            est = predict_layout(self.counted, self.hw, layout, schedule, self.sims, costs)
        except ConfigError:  # a tp or cp that splits no heads evenly
            return None
        self.steps[layout] = est.step_s
        return est


__all__ = ["Predictor"]
