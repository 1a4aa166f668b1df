"""Gradients, losses and parameters through the pipeline equal the unsplit model's."""

from __future__ import annotations

from typing import Any

import pytest

import conveyor
from tests.support.helpers import assert_close, merge, mse, pipelined, reference
from tests.support.models import batch, mlp
from tests.support.trainer_forked import run_forked

# (schedule, chunks, micro-batches, batch size of each step): even splits, uneven ones,
# batch sizes that change between steps, and fewer micro-batches than ranks.
CONFIGS = [
    ("gpipe", 1, 4, [16, 16, 16]),
    ("gpipe", 1, 3, [10, 7, 11]),
    ("1f1b", 1, 4, [16, 16, 16]),
    ("1f1b", 1, 3, [10, 7, 11]),
    ("interleaved-1f1b", 2, 4, [16, 16, 16]),
    ("interleaved-1f1b", 2, 3, [10, 7, 11]),
    ("looped-bfs", 2, 3, [10, 7, 11]),
    ("zb-h1", 1, 4, [16, 16, 16]),
    ("zb-h1", 1, 3, [10, 7, 11]),
    ("zb-h2", 1, 5, [10, 7, 11]),
    ("zb-late", 1, 4, [16, 16, 16]),
    ("zbv", 2, 4, [16, 16, 16]),
    ("zbv", 2, 3, [10, 7, 11]),
    ("dualpipev", 2, 7, [14, 9, 15]),
    ("zb-auto", 1, 5, [10, 7, 11]),
    ("zb-auto", 2, 4, [16, 16, 16]),  # its V: Pipeline(schedule="zb-auto", chunks=2)
]


def _steps(sizes: list[int]) -> list[Any]:
    return [batch(n, seed=i) for i, n in enumerate(sizes)]


def _run_all(rank: int, pp: int) -> dict[tuple[str, int, int], Any]:
    """Every schedule and split on this process; returns results keyed by config."""
    ctx = conveyor.init(pp=pp)
    out = {}
    for name, chunks, m, sizes in CONFIGS:
        pipe = conveyor.Pipeline(
            mlp(), loss_fn=mse, microbatches=m, schedule=name, chunks=chunks, context=ctx
        )
        out[(name, chunks, m)] = pipelined(pipe, _steps(sizes))
    return out


def _check(results: list[dict[tuple[str, int, int], Any]]) -> None:
    for name, chunks, m, sizes in CONFIGS:
        want_losses, want_grads, want_params = reference(mlp(), _steps(sizes))
        per_rank = [r[(name, chunks, m)] for r in results]
        what = f"{name} chunks={chunks} m={m}"
        for losses, _, _ in per_rank:
            assert losses == pytest.approx(want_losses, rel=1e-5), what
        assert_close(merge([g for _, g, _ in per_rank]), want_grads, what + " grads")
        assert_close(merge([p for _, _, p in per_rank]), want_params, what + " params")


def test_single_process_world_runs_every_schedule() -> None:
    _check([_run_all(0, pp=4)])


def test_single_process_world_one_stage() -> None:
    _check([_run_all(0, pp=1)])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_multi_process_equals_unsplit_model(world: int) -> None:
    _check(run_forked(_run_all, world, world))
