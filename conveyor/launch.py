"""``conveyor launch`` / ``python -m conveyor.launch``: a thin front to ``torchrun``.

Every argument goes to ``torch.distributed.run`` unchanged, so anything torchrun accepts
works here::

    python -m conveyor.launch --nproc-per-node 2 train.py --lr 0.1
    python -m conveyor.launch --nnodes 2 --node-rank 0 --master-addr host0 \\
        --nproc-per-node 4 train.py

Two differences, each only when the variable is not already set:

- ``OMP_NUM_THREADS=1``, so on CPU each process computes with one thread and the processes
  do not fight over the cores (torchrun itself only does that, with a warning, for more
  than one process per node). Set it yourself to give each process more threads.
- glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (1 GiB): freed
  gradient and activation buffers stay in the heap for the next step instead of going back
  to the OS, which otherwise makes every step fault in fresh pages (measured: 8 fused weight
  gradients of 4 x Linear(1024) cost 12.3 ms with ``.grad`` set to None each step, 8.6 ms
  with these set, 7.0 ms with ``.grad`` kept). Memory then stays at its peak, as with
  PyTorch's caching allocators.

Surviving a lost process: ``--max-restarts N`` is torchrun's elastic restart. When a worker
dies, torchrun stops the others (conveyor's bounded waits, ``conveyor.init(timeout=...)``,
make sure none hangs meanwhile) and starts them all again, up to N times; a script that
saves with :func:`conveyor.save` and resumes with :func:`conveyor.load` then loses at most
the steps since its last checkpoint::

    conveyor launch --nproc-per-node 2 --max-restarts 3 train.py --checkpoint ckpt

For that, with ``--max-restarts`` above 0 the launcher also sets, unless set,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: in torch 2.13 the restarted workers otherwise
reuse the first attempt's rendezvous store and their process group connects to the dead
workers' stale addresses (pytorch/pytorch#135712); and on one machine it uses the c10d
rendezvous on a free port (``--standalone``) instead of the static one, whose store also
outlives the attempt. On several machines use ``--rdzv-backend c10d --rdzv-endpoint
HOST:PORT --rdzv-id JOB`` for restarts.
"""

from __future__ import annotations

import os
import sys

# glibc reads these at process start, so the launcher sets them for its workers.
MALLOC_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``); return its exit code.

    A worker that fails makes this return that worker's exit code (1 if it has none),
    after torchrun has printed which rank failed and why.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in MALLOC_TUNABLES:
        os.environ.setdefault(name, str(1 << 30))
    config = parse_args(args)  # type: ignore[no-untyped-call]
    if config.max_restarts > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if config.rdzv_backend == "static" and str(config.nnodes) in ("1", "1:1"):
            config.standalone = True
    try:
        run(config)  # type: ignore[no-untyped-call]
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        codes = [f.exitcode for f in e.failures.values() if f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
