"""Multi-process runs for the trainer tests, with forked workers.

:func:`tests.support.distributed.run` spawns fresh interpreters, each importing torch (and, for
the transformers tests, transformers and accelerate: about 10 s of CPU each). Forked
workers inherit this process's imports, which on 2 cores makes a 4-process test take a
quarter of the time. Each worker is :func:`tests.support.distributed._worker` (gloo, one thread).
Fork only from a process that has not started a process group or compute threads pools
(the test process: one thread, see conftest.py).
"""

from __future__ import annotations

from typing import Any

from tests.support import distributed


def run_forked(fn: Any, world: int, *args: Any, timeout: float = 200) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` forked processes; returns the results by rank.

    Raises if a rank fails or one gives no answer within ``timeout`` seconds (the workers'
    conveyor time-out is :data:`tests.support.distributed.CONVEYOR_TIMEOUT`, below it)."""
    return distributed.run(fn, world, *args, timeout=timeout, fork=True)
