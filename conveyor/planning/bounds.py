"""Lower bounds on a layout's step time and memory, without its schedule: what lets
:func:`~conveyor.planning.search.rank_layouts` simulate only the layouts that can still
be among the best (branch and bound).

Every bound never exceeds the prediction (:func:`~conveyor.planning.prediction.predict`):

- **work** (:func:`work_bound`, no cut into stages needed): the busiest rank works no
  less than the average, ``microbatches`` x every unit's time / ``pp``.

- **step**: a rank starts its first action no earlier than the forwards of the stages
  before its first stage take, one after another (each F waits for the one before it),
  then runs every one of its actions one at a time (``microbatches`` x (F + B + W) of
  each of its stages); without a split backward its last action is a B, which the Bs of
  the stages before it follow. The step is the simulated makespan plus a tail >= 0. A
  recomputing B's forward again is left out (a B right after its own F re-runs nothing),
  unless the schedule's share of Bs that re-run it is given (``recomputed``: what
  :func:`~conveyor.planning.prediction.stage_costs` adds to the B it simulates).
  After its last action a rank still reduces a stage's gradients, gathers what FSDP
  could not hide and steps its optimizer (:func:`~conveyor.planning.prediction.tail`).
- **memory**: a rank's parameters, gradients, optimizer state and buffers exactly as
  :func:`~conveyor.planning.memory.rank_memory` counts them, and of its activations only
  what one forward of one of its stages keeps plus its temporaries (every stage runs a
  forward; what the rank holds is never below 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.planning.costs import Costs, UnitCost
from conveyor.planning.layout import Layout
from conveyor.planning.memory import Setting, compute_width, stage_bytes, state_bytes_of
from conveyor.planning.prediction import Sync

GB = 1e9


def split_backward(schedule: str) -> bool:
    """Whether the search's schedule ``schedule`` splits the backward into B and W."""
    return schedule.startswith("zb")


def placement(layout: Layout) -> list[int]:
    """The pipeline rank of each stage: the stage's own rank with one chunk, round robin
    over the ranks when interleaved, a V (down the ranks, then back up) for ``zbv``."""
    p, stages = layout.pp, layout.pp * layout.chunks
    if layout.schedule == "zbv":
        return [s if s < p else 2 * p - 1 - s for s in range(stages)]
    return [s % p for s in range(stages)]


SLACK = 1 - 1e-9
"""Each bound is lowered by this factor: it adds the same times in another order than
the simulator, which may round differently."""


def work_bound(costs: Costs, layout: Layout) -> float:
    """Seconds a step of ``layout`` takes at least, whatever its cut into stages (see the
    module docstring): a rank works through its actions one at a time."""
    total = sum(costs.times(split_backward(layout.schedule)))
    return layout.microbatches * total / layout.pp * SLACK


def step_bound(
    costs: Costs,
    balance: Sequence[int],
    layout: Layout,
    sync: Sync | None = None,
    recomputed: Sequence[float] | None = None,
) -> float:
    """Seconds a step of ``layout`` takes at least (see the module docstring); with its
    ``sync``, each rank's optimizer step, FSDP gathers not hidden behind its longest
    forward and (unless it overlaps the backward) its shortest stage's gradient reduction
    after its last action too; with ``recomputed`` (per stage, the share of its Bs that
    run its forward again: :func:`~conveyor.planning.prediction.recomputed_shares` of the
    schedule of a layout that recomputes), that forward in each B."""
    split = split_backward(layout.schedule)
    plain = costs.costs(balance, split)
    send = costs.comm(balance) if costs.blocking else 0.0
    last = len(plain) - 1
    over = costs.overhead
    again = [0.0] * len(plain) if recomputed is None else recomputed
    per = [
        (f + over + (send if s < last else 0.0), b + over + f * a + (send if s > 0 else 0.0), w)
        for s, ((f, b, w), a) in enumerate(zip(plain, again, strict=True))
    ]
    ranks = placement(layout)
    m = layout.microbatches
    busy = [0.0] * layout.pp
    head = [float("inf")] * layout.pp
    tail = [float("inf")] * layout.pp
    before_f = before_b = 0.0
    for s, (f, b, w) in enumerate(per):
        r = ranks[s]
        busy[r] += m * (f + b + w)
        head[r] = min(head[r], before_f)
        tail[r] = min(tail[r], 0.0 if split else before_b)
        before_f += f
        before_b += b
    least = max(h + t + u for h, t, u in zip(head, tail, busy, strict=True))
    if sync is not None:
        parts = costs.parts(balance)
        for r in range(layout.pp):
            stages = [s for s in range(len(per)) if ranks[s] == r]
            units = [u for s in stages for u in parts[s]]
            after = sync.update(units)
            if layout.dp_overlap != "backward":
                after += min(sync.reduce(parts[s]) for s in stages)
            gathers = sum(sync.gather(parts[s]) for s in stages)
            after += max(0.0, gathers - max(per[s][0] for s in stages))
            least = max(least, head[r] + busy[r] + after)
    return least * SLACK


def memory_bound(costs: Costs, balance: Sequence[int], layout: Layout, setting: Setting) -> float:
    """GB the fullest rank of ``layout`` holds at least (see the module docstring)."""
    parts = costs.parts(balance)
    ranks = placement(layout)
    least = 0.0
    for rank in range(layout.pp):
        stages = [s for s in range(len(parts)) if ranks[s] == rank]
        units: list[UnitCost] = [u for s in stages for u in parts[s]]
        kinds = state_bytes_of(units, setting)
        kinds["activations"] = max(
            sum(stage_bytes(parts[s], setting.recompute)[::3]) for s in stages
        )
        kinds["buffers"] = _buffers(parts, stages, units, layout.pp, setting)
        least = max(least, sum(kinds.values()))
    return least / GB * SLACK


def _buffers(
    parts: Sequence[Sequence[UnitCost]],
    stages: Sequence[int],
    units: Sequence[UnitCost],
    ranks: int,
    setting: Setting,
) -> float:
    # As memory.rank_memory's buffers, with the stages placed by placement().
    total = setting.buffer
    if ranks > 1:
        total += 2 * max(parts[s][-1].output for s in stages)
    if setting.fsdp == "reshard":
        total += 2 * 2 * max((compute_width(setting, u) * u.count for u in units), default=0.0)
    elif setting.fsdp:
        total += 2 * sum(compute_width(setting, u) * u.count for u in units)
    return total


__all__ = ["memory_bound", "placement", "split_backward", "step_bound", "work_bound"]
