"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Both split each backward into B (gradient of the stage input, on the critical path) and
W (gradient of the weights, which nothing waits for), one stage per rank. ZB-H1 keeps
1F1B's memory; ZB-H2 spends up to 2p-1 micro-batches of activations to remove the bubble.
"""

from __future__ import annotations

from conveyor.schedules.core import Action, B, F, Schedule, W, check_sizes, loop_placement
from conveyor.schedules.greedy import greedy_run
from conveyor.schedules.one_f_one_b import one_f_one_b


def zb_h1_program(ranks: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s ZB-H1 program: 1F1B's F/B order, each W ``rank`` B's late.

    Delaying W on later ranks lets B travel back at B's speed rather than B+W's; the
    delayed W's fill the tail that 1F1B leaves idle. Holds at most min(p, m) micro-batches.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).
        rank: The rank, which runs stage ``rank``.

    Returns:
        The rank's F, B and W actions in order.
    """
    warmup = min(ranks - rank - 1, microbatches)
    program = [Action(F, rank, mb) for mb in range(warmup)]
    next_w = 0  # the micro-batch of the next W

    def backward(mb: int) -> None:
        """Append B of ``mb``, then (from micro-batch ``rank`` on) the next W."""
        nonlocal next_w
        program.append(Action(B, rank, mb))
        if mb >= rank:
            program.append(Action(W, rank, next_w))
            next_w += 1

    for i in range(microbatches - warmup):
        program.append(Action(F, rank, warmup + i))
        backward(i)
    for mb in range(microbatches - warmup, microbatches):
        backward(mb)
    program.extend(Action(W, rank, mb) for mb in range(next_w, microbatches))
    return tuple(program)


def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with split backward and late W's; any m >= 1.

    Every rank holds at most 1F1B's peak, min(p, m) micro-batches. With F = B = W = t and
    m >= p the makespan is (3m + p - 1)t, against 1F1B's 3(m + p - 1)t.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"zb-h1"``, with ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches)
    return Schedule(
        name="zb-h1",
        ranks=ranks,
        microbatches=microbatches,
        placement=loop_placement(ranks, 1),
        actions=tuple(zb_h1_program(ranks, microbatches, r) for r in range(ranks)),
        split_backward=True,
    )


def zb_late(ranks: int, microbatches: int) -> Schedule:
    """1F1B's F/B order with split backward and every W at the end; any m >= 1.

    The critical path carries only F and B (the input-gradient half), and the runtime runs a
    rank's consecutive W's as one, a single GEMM per linear weight over all micro-batches,
    instead of m small ones. The price is memory: what W needs is held for all m
    micro-batches, as in GPipe. Fastest of the one-chunk schedules when that fits.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.

    Returns:
        The schedule, named ``"zb-late"``, with ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches)
    programs = []
    for program in one_f_one_b(ranks, microbatches).actions:
        weight_grads = [Action(W, a.stage, a.microbatch) for a in program if a.kind == B]
        programs.append(program + tuple(weight_grads))
    return Schedule(
        name="zb-late",
        ranks=ranks,
        microbatches=microbatches,
        placement=loop_placement(ranks, 1),
        actions=tuple(programs),
        split_backward=True,
    )


def zb_h2(ranks: int, microbatches: int) -> Schedule:
    """ZB-H2: more warm-up forwards and W's moved to the tail; any m >= 1.

    The order is found by running the greedy B > F > W scheduler
    (:func:`~conveyor.schedules.greedy.greedy_run`) with unit costs and a cap of
    2p-1 micro-batches per rank: rank r warms up with 2(p-r)-1 forwards, exactly enough
    to reach its first B, and the W's left over fill the tail. With F = B = W and
    m >= 2p-1 no rank idles between its first and last action: the span is m(F+B+W).

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"zb-h2"``, with ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches)
    placement = loop_placement(ranks, 1)
    cap = 2 * ranks - 1
    run = greedy_run(placement, microbatches, [(1.0, 1.0, 1.0)] * ranks, [cap] * ranks)
    assert run is not None  # no bound: never stopped early
    programs = run.programs
    return Schedule(
        name="zb-h2",
        ranks=ranks,
        microbatches=microbatches,
        placement=placement,
        actions=tuple(tuple(program) for program in programs),
        split_backward=True,
    )
