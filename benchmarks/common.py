"""What the distributed benchmark scripts share: starting themselves on N processes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch.distributed as dist

from conveyor.context import in_torchrun
from conveyor.launch import main as launch


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
