"""What the distributed benchmark scripts share: starting themselves on N processes."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from conveyor.cli.launch import main as launch
from conveyor.context import in_torchrun

Step = Callable[[], None]


def step_times(step: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` between two barriers, after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def alternate(
    runs: dict[Any, Step],
    baseline: Step | None,
    rounds: int,
    timed: Callable[..., list[float]],
    steps: int,
    warmup: int,
) -> tuple[dict[Any, list[float]], list[float]]:
    """Seconds per step of every run and of ``baseline`` (a one-process loop this rank
    runs while the others wait), round by round; the runs' order flips every round so
    drift hits all alike."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    one_process: list[float] = []
    for r in range(rounds):
        dist.barrier()
        if baseline is not None:
            one_process += timed(baseline, steps, warmup, sync=False)
        dist.barrier()  # the other ranks idle here while this one measures the baseline
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[key] += timed(runs[key], steps, warmup)
    return times, one_process


def run_on_processes(
    script: str,
    procs: int,
    argv: list[str],
    worker: Callable[[argparse.Namespace], None],
    args: argparse.Namespace,
) -> int:
    """Outside torchrun, launch ``script`` with ``argv`` on ``procs`` processes (one thread
    each) and return its exit code; inside, run ``worker(args)`` and leave the group."""
    if not in_torchrun():
        os.environ["OMP_NUM_THREADS"] = "1"
        return launch(["--nproc-per-node", str(procs), os.path.abspath(script), *argv])
    worker(args)
    dist.destroy_process_group()
    return 0
