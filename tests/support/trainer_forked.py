"""Multi-process runs for the trainer tests, with forked workers.

:func:`tests.support.distributed.run` spawns fresh interpreters, each importing torch (and, for
the transformers tests, transformers and accelerate: about 10 s of CPU each). Forked
workers inherit this process's imports, which on 2 cores makes a 4-process test take a
quarter of the time. Each worker is :func:`tests.support.distributed._worker` (gloo, one thread).
Fork only from a process that has not started a process group or compute threads pools
(the test process: one thread, see conftest.py).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.support import distributed


def run_forked(fn: Any, world: int, *args: Any, timeout: float = 200) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` forked processes; returns the results by rank.

    Raises if a rank fails or one gives no answer within ``timeout`` seconds (the workers'
    conveyor time-out is :data:`tests.support.distributed.CONVEYOR_TIMEOUT`, below it)."""
    if torch.distributed.is_initialized():  # a forked group would be this one's: spawn
        return list(distributed.run(fn, world, *args, timeout=timeout))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = distributed.free_port()
    procs = [
        ctx.Process(target=distributed._worker, args=(r, world, port, fn, args, queue, {}))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        ranks = list(range(world))
        for _ in ranks:
            rank, status, value = distributed.answer(queue, timeout, ranks, results, {})
            assert status == "ok", f"rank {rank}: {value}"
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
