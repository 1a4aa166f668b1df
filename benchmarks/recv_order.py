"""Does the order of operations inside one ``batch_isend_irecv`` group matter on gloo?

The runtime posts each group's sends before its receives (``conveyor/runtime/channel.py``:
a peer that already waits for the send should not wait through the receives' posting).
This measures the order where neither end waits: 2 processes on gloo, one thread each, swap a
tensor every round, as two neighbouring pipeline ranks do when one sends an activation
and the other an input gradient in the same tick, with the receive posted first or the
send posted first, alternating the two orders round by round so drift hits both alike.

    python benchmarks/recv_order.py [--sizes 1024,262144,4194304] [--rounds 20] [--swaps 20]

Prints a markdown table: per message size, the median microseconds per swap with the
receive first and with the send first, and their ratio. Two runs on 2 shared CPU cores
(torch 2.13, 20 rounds of 10 swaps; ratio = send first / receive first):

| bytes      | run 1 | run 2 |
|------------|-------|-------|
|      4,096 |  0.99 |  1.00 |
|  1,048,576 |  1.10 |  0.91 |
| 16,777,216 |  1.00 |  0.99 |
| 67,108,864 |  1.06 |  1.05 |

No order wins beyond the noise between runs when both ends post at once; the runtime's
sends-first order is for the end that is already waiting (see the comment in ``Remote``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from common import run_on_processes

ORDERS = ("receive first", "send first")


def _swap(out: torch.Tensor, into: torch.Tensor, peer: int, receive_first: bool) -> None:
    recv = dist.P2POp(dist.irecv, into, peer)
    send = dist.P2POp(dist.isend, out, peer)
    for work in dist.batch_isend_irecv([recv, send] if receive_first else [send, recv]):
        work.wait()


def _timed(out: torch.Tensor, into: torch.Tensor, peer: int, first: bool, swaps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(swaps):
        _swap(out, into, peer, first)
    return (time.perf_counter() - start) / swaps


def worker(args: argparse.Namespace) -> None:
    """Each size: warm up, then rounds of ``swaps`` swaps in either order."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    rows = []
    for numel in args.sizes:
        out, into = torch.full((numel,), float(rank)), torch.empty(numel)
        for first in (True, False):
            _timed(out, into, peer, first, 3)
        times: dict[str, list[float]] = {name: [] for name in ORDERS}
        for r in range(args.rounds):
            order = ORDERS if r % 2 == 0 else ORDERS[::-1]
            for name in order:
                times[name].append(_timed(out, into, peer, name == ORDERS[0], args.swaps))
        assert torch.equal(into, torch.full((numel,), float(peer)))  # the swap really happened
        first, second = (statistics.median(times[name]) * 1e6 for name in ORDERS)
        ratio = second / first
        rows.append(f"| {numel * 4:>11,} | {first:10.1f} | {second:10.1f} | {ratio:5.2f} |")
    if rank == 0:
        print("| bytes       | recv first | send first | ratio |")
        print("|-------------|------------|------------|-------|")
        print("\n".join(rows), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run on 2 processes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,262144,4194304",
                        help="float32 elements per message, comma-separated")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--swaps", type=int, default=20)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return run_on_processes(__file__, 2, sys.argv[1:] if argv is None else argv, worker, args)


if __name__ == "__main__":
    sys.exit(main())
