"""This machine's :class:`~conveyor.planning.devices.Hardware` fields, measured once by
micro-benchmarks (:func:`measure`, behind :meth:`Hardware.measure`, which makes them a
``Hardware``: this module stays below it).

What the counted source needs of a device, each timed here on the device conveyor's ranks
run on (the GPU when there is one, else the CPU with the thread count a rank uses):

- matrix multiplies: the rate of ``(small x middle) @ (middle x middle)`` for a grid of
  sizes (:data:`SMALL`, :data:`MIDDLE`), used by the shape nearest a counted multiply;
- attention: ``scaled_dot_product_attention`` with a causal mask, forward and backward,
  at a few sequence lengths;
- memory bandwidth: a large element-wise copy's bytes read and written per second, and
  an element-wise product's at a few sizes (:data:`ELEMENTWISE`), used by the size
  nearest a counted operation's;
- a kernel's launch: the time of an operation on one element;
- the link between processes: latency and bandwidth of a send between two ranks
  (:func:`~conveyor.planning.link.measure_link_speed`), on the process group when one is
  running, else between two processes started for it;
- the runtime's own cost per action (on a CPU, where the host runs every kernel itself):
  a ``Pipeline`` of two one-multiply stages run on those two processes, and the time
  each rank spends per F or B beyond its waits for the other
  (:func:`action_overhead`). On a GPU the kernels queue while the host goes on: 0.

Each kernel is timed as it runs in a training step, not on operands it has just used:
a step keeps every layer's activations for the backward, so its operations write fresh
memory and read what an earlier layer wrote, beyond the core's own cache. Repeating one
multiply on the same operands and output ran the multiplies of a Llama layer here 16-33%
faster than they run inside the model, and its element-wise operations 1.7-3 times
faster; so every timing cycles through sets of operands and outputs that together
exceed :data:`POOL_BYTES`.

On a CPU the kernels are timed in the thread's CPU seconds, not the wall clock's: other
processes on a shared machine take cores from a timing (twice its time, seen here), never
CPU seconds.

The result is kept for the process and in a file under ``~/.cache/conveyor`` (or
``$CONVEYOR_CACHE``) named for the host, the device, the thread count and torch's
version, so each machine is measured once.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.runtime.timing import Timing

Fields = dict[str, Any]
"""Keyword arguments of :class:`~conveyor.planning.devices.Hardware`."""

SMALL = (16, 64, 256, 1024)
"""The smallest dimensions of the multiplies timed."""
MIDDLE = (256, 1024, 2048)
"""The two other dimensions of the multiplies timed."""
SEQUENCES = (64, 256, 1024)
"""Sequence lengths the attention is timed at."""
ELEMENTWISE = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
"""Elements of the tensors an element-wise product is timed at (64 KiB to 16 MiB each
in fp32)."""
POOL_BYTES = 64 << 20
"""What the operand sets a timing cycles through hold together, at least: beyond a CPU
core's cache (2 MiB of L2 here) and a GPU's L2 (50 MB on an H100)."""
MAX_SETS = 256
"""The most operand sets one timing cycles through (the smallest multiplies)."""

VERSION = "v3"
"""What the cache file's name carries: a file measured by another version is measured
again (v2: CPU seconds on a CPU, the runtime's cost per action; v3: operands cycled
beyond the cache, element-wise rates by size)."""

TINY_MICROBATCHES = 8
"""Micro-batches of the tiny pipeline :func:`action_overhead` times."""

_MEASURED: dict[str, Fields] = {}


def measure(*, refresh: bool = False) -> Fields:
    """This machine's device, measured once (see the module docstring) and cached for the
    process and on disk; ``refresh`` measures it again."""
    device = _device()
    key = f"{platform.node()}-{device.type}-{torch.get_num_threads()}t-torch{torch.__version__}"
    if not refresh and key in _MEASURED:
        return _MEASURED[key]
    path = _cache_dir() / f"hardware-{VERSION}-{key}.json"
    hw = None if refresh else _load(path)
    if hw is None:
        hw = _measure(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(hw))
    _MEASURED[key] = hw
    return hw


def _cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def _load(path: Path) -> Fields | None:
    try:
        fields: Fields = json.loads(path.read_text())
        fields["matmul_table"] = tuple(tuple(p) for p in fields["matmul_table"])
        fields["attention_table"] = tuple(tuple(p) for p in fields["attention_table"])
        fields["bandwidth_table"] = tuple(tuple(p) for p in fields["bandwidth_table"])
        return fields
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or unreadable
        return None


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _seconds(fn: Callable[[], object], device: torch.device, least: float = 0.02) -> float:
    """Seconds of one call of ``fn``: the best of five timings, each repeated until it
    lasts ``least``; on a CPU in this thread's CPU seconds (the module docstring)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock = time.perf_counter if device.type == "cuda" else time.thread_time

    fn()
    sync()
    calls = 1
    while True:
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        if clock() - t0 >= least or calls >= 1 << 16:
            break
        calls *= 4
    times = []
    for _ in range(5):
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        times.append((clock() - t0) / calls)
    return min(times)  # a shared machine's other load only ever slows a timing


def cycling(
    op: Callable[..., object], make: Callable[[], Sequence[torch.Tensor]]
) -> Callable[[], None]:
    """A call of ``op`` on the next of as many operand sets ``make()`` as fill
    :data:`POOL_BYTES` (at most :data:`MAX_SETS`, at least two), in turn."""
    first = make()
    size = sum(t.nbytes for t in first)
    sets = [first] + [make() for _ in range(min(MAX_SETS, max(2, -(-POOL_BYTES // size))) - 1)]
    turn = itertools.cycle(sets)

    def call() -> None:
        op(*next(turn))

    return call


def multiply_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``a @ b`` written into ``out``: the multiply every timing of one cycles through."""
    torch.mm(a, b, out=out)


def _measure(device: torch.device) -> Fields:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def tensors(
        *shapes: tuple[int, ...], kind: torch.dtype = dtype
    ) -> Callable[[], list[torch.Tensor]]:
        return lambda: [torch.randn(s, device=device, dtype=kind) for s in shapes]

    def mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(a, b, out=out)

    table = []
    for small in SMALL:
        for middle in MIDDLE:
            if small > middle:
                continue
            shapes = ((small, middle), (middle, middle), (small, middle))
            t = _seconds(cycling(multiply_into, tensors(*shapes)), device)
            table.append((small, middle, 2 * small * middle * middle / t / 1e12))
    big = torch.empty(1 << 24, device=device, dtype=torch.float32)  # 64 MiB
    out = torch.empty_like(big)
    bandwidth = 2 * big.nbytes / _seconds(lambda: torch.add(big, 1.0, out=out), device) / 1e9
    rates = []
    for n in ELEMENTWISE:  # fp32, as a count's bytes are
        moved = 3 * 4 * n
        t = _seconds(cycling(mul, tensors((n,), (n,), (n,), kind=torch.float32)), device)
        rates.append((float(moved), moved / t / 1e9))
    one, one_out = big[:1], out[:1]
    launch = _seconds(lambda: torch.add(one, 1.0, out=one_out), device)
    latency, link, overhead = _link()
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 1e9
        per_node = torch.cuda.device_count()
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        per_node = os.cpu_count() or 1
    best = max(rate for *_, rate in table)
    return dict(
        peak_tflops=best,
        hbm_gb=memory,
        hbm_gbps=bandwidth,
        gpus_per_node=per_node,
        intra_node_gbps=link / 1e9,
        inter_node_gbps=link / 1e9,
        matmul_tflops=best,
        name=f"measured {device.type} ({platform.node()})",
        action_overhead=overhead if device.type == "cpu" else 0.0,
        launch_s=launch,
        memory_efficiency=1.0,
        latency_s=latency,
        matmul_table=tuple(table),
        attention_table=_attention(device, dtype),
        bandwidth_table=tuple(rates),
    )


def _attention(device: torch.device, dtype: torch.dtype) -> tuple[tuple[int, float], ...]:
    """(sequence, TFLOP/s) of causal attention's forward and backward, FLOPs counted as
    :meth:`Hardware.attention_seconds` takes them: 4 s^2 d in F, 2.5 times that in B,
    half of it under the causal mask."""
    heads, dim = 4, 64

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o.sum(), (q, k, v))

    out = []
    for seq in SEQUENCES:

        def qkv(seq: int = seq) -> list[torch.Tensor]:
            shape = (1, heads, seq, dim)
            return [
                torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            ]

        flops = 3.5 * 4 * seq * seq * heads * dim / 2
        out.append((seq, flops / _seconds(cycling(step, qkv), device) / 1e12))
    return tuple(out)


def _link() -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s) of a send between two ranks, and the runtime's cost
    per action (:func:`action_overhead`; 0 on a GPU)."""
    from conveyor.planning.link import measure_link_speed

    running = dist.is_initialized() and dist.get_world_size() > 1
    if running and torch.cuda.is_available():
        return (*measure_link_speed(large=1 << 26, rounds=5), 0.0)
    # Two fresh interpreters (not multiprocessing's spawn, which re-runs the caller's
    # script unless it guards its main).
    port = _free_port()
    code = f"from conveyor.planning.machine import link_rank; link_rank({{}}, {port})"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code.format(r)], stdout=subprocess.PIPE, env=env)
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=300)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    latency, bandwidth, overhead = json.loads(out.decode().strip().splitlines()[-1])
    if running:  # the job's own link, its cost per action from the pair
        latency, bandwidth = measure_link_speed(large=1 << 26, rounds=5)
    return float(latency), float(bandwidth), float(overhead)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def link_rank(rank: int, port: int) -> None:
    """One of the two processes :func:`measure` starts to time the link and the
    runtime's cost per action; rank 0 prints ``[latency, bandwidth, overhead]``."""
    from conveyor.planning.link import measure_link_speed

    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # 64 MiB messages, beyond the noise; the best of three, as others' load only slows
        tries = [measure_link_speed(large=1 << 26, rounds=5) for _ in range(3)]
        result = (min(t[0] for t in tries), max(t[1] for t in tries))
        overhead = action_overhead() if backend == "gloo" else 0.0
        if rank == 0:
            print(json.dumps([*result, overhead]), flush=True)
    finally:
        dist.destroy_process_group()


def action_overhead(steps: int = 10, warmup: int = 3) -> float:
    """Seconds conveyor's runtime spends per F or B beyond its kernels, on the running
    two-rank group: a pipeline of two stages of one 4 x 4 multiply each, 1F1B over
    :data:`TINY_MICROBATCHES` micro-batches; per rank, its span from first to last action
    less its waits for the other rank, over its actions (the bookkeeping around and
    between actions; the tiny stage's own kernels, a few launches, are in it too). The
    best step of each rank (other load only slows), the mean of the two."""
    import math

    from torch import nn

    from conveyor._build import build
    from conveyor._options import Options
    from conveyor.context import init
    from conveyor.runtime import microbatch
    from conveyor.schedules.registry import get_schedule

    ctx = init(pp=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x, y = torch.randn(TINY_MICROBATCHES, 4), torch.randn(TINY_MICROBATCHES, 4)
    m = TINY_MICROBATCHES
    options = Options(loss_fn=nn.functional.mse_loss, microbatches=m, balance=[1, 1])
    parts = build(model, get_schedule("1f1b", 2, m), options, ctx, microbatch.first(x, m))
    best = math.inf
    for step in range(warmup + steps):
        record = parts.stepper.run("train", x, y).record  # the step a pipeline runs
        if step >= warmup:
            best = min(best, per_action(record.timings, record.waits))
    both = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(both)
    return float(both.item()) / 2


def per_action(actions: Sequence[Timing], waits: Sequence[Timing]) -> float:
    """One rank's seconds per F or B of a step: from its first action's start to its
    last one's end, less the waits for another rank in between, over its F and B actions
    (its W, none in 1F1B, would count as time)."""
    fb = [a for a in actions if a.kind in ("F", "B")]
    first, last = min(a.start for a in actions), max(a.end for a in actions)
    waited = sum(w.end - w.start for w in waits if w.start >= first and w.end <= last)
    return (last - first - waited) / len(fb)


__all__ = [
    "ELEMENTWISE",
    "MIDDLE",
    "POOL_BYTES",
    "SEQUENCES",
    "SMALL",
    "action_overhead",
    "cycling",
    "link_rank",
    "measure",
    "multiply_into",
    "per_action",
]
