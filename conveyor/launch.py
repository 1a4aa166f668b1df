"""``conveyor launch`` / ``python -m conveyor.launch``: a thin front to ``torchrun``.

Every argument goes to ``torch.distributed.run`` unchanged, so anything torchrun accepts
works here::

    python -m conveyor.launch --nproc-per-node 2 train.py --lr 0.1
    python -m conveyor.launch --nnodes 2 --node-rank 0 --master-addr host0 \\
        --nproc-per-node 4 train.py

One difference: ``OMP_NUM_THREADS`` is set to 1 when it is not already set, so on CPU each
process computes with one thread and the processes do not fight over the cores (torchrun
itself only does that, with a warning, for more than one process per node). Set
``OMP_NUM_THREADS`` yourself to give each process more threads.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``); return its exit code.

    A worker that fails makes this return that worker's exit code (1 if it has none),
    after torchrun has printed which rank failed and why.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args(args))  # type: ignore[no-untyped-call]
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        codes = [f.exitcode for f in e.failures.values() if f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
