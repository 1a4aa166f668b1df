"""The link between pipeline ranks: latency and bandwidth, measured by ping-pong."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

# Without a process group there is nothing to measure; these are typical of gloo over
# loopback on one machine (tens of microseconds per message, a few GB/s).
DEFAULT_LATENCY = 50e-6
DEFAULT_BANDWIDTH = 3e9


def measure_link_speed(
    small: int = 4, large: int = 1 << 20, rounds: int = 10
) -> tuple[float, float]:
    """Latency and bandwidth between ranks 0 and 1 by ping-pong; a collective.

    Every rank calls it; ranks other than 0 and 1 only receive the result. One-way time is
    half a round trip (median over ``rounds``).

    Args:
        small: Floats per message for the latency.
        large: Bytes per message for the bandwidth (from its extra time over ``small``).
        rounds: Timed round trips per size, after two untimed ones.

    Returns:
        (latency in seconds, bandwidth in bytes per second), the same on every rank.
    """
    rank = dist.get_rank()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def one_way(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        times = []
        for r in range(rounds + 2):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if r >= 2:
                times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times)

    result = torch.zeros(2, dtype=torch.float64)
    if rank in (0, 1):
        lat = one_way(small)
        big = one_way(large // 4)
        result[0] = lat
        result[1] = large / max(big - lat, 1e-9)
    dist.broadcast(result, 0)
    return float(result[0]), float(result[1])


__all__ = ["DEFAULT_BANDWIDTH", "DEFAULT_LATENCY", "measure_link_speed"]
