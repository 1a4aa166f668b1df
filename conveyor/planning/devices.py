"""The GPUs a cluster plan is for: their data-sheet numbers and the rates kernels reach.

:class:`Hardware` is what a data sheet gives. How fast an operation runs on it is a
roofline (Williams, Waterman and Patterson, CACM 2009): an operation takes the longer of
its FLOPs at the achievable compute rate and its bytes at the achievable memory rate, so
its rate grows with its arithmetic intensity (FLOPs per byte, which grows with its size)
up to the compute ceiling. The ceilings are measured, not fitted to training runs (the
sources are in ``docs/guide/cluster.md``):

- matrix multiplies: the maximum achievable matmul FLOPS (MAMF) measured on each GPU in
  bf16 (stas00/ml-engineering, ``compute/accelerator/README.md``): A100 SXM 271.2 of 312,
  H100 SXM 794.5 of 989 ("H200 is the same");
- fused attention: FlashAttention-2's forward + backward benchmark at each sequence
  length, head dimension 128 (Dao-AILab/flash-attention, ``assets/flash2_*_fwd_bwd_
  benchmark.png``), read at the layout's sequence length (log-linear between points);
- everything else is memory-bound: its bytes at 0.84 of the HBM bandwidth, the measured
  coalesced-load ceiling on H100 (the one measurement found; NVIDIA claims 0.95 for A100);
- kernels as they run: a multiply's tiles run in whole waves over the multiprocessors
  (:meth:`Hardware.matmul_seconds`), and each kernel costs its launch (:data:`LAUNCH_S`).

:meth:`Hardware.measure` gives this machine instead: its rates by shape, its memory
bandwidth, the link between its processes and the runtime's cost per action, measured
(:mod:`~conveyor.planning.machine`; on a CPU in CPU seconds, which other load does not
stretch).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.planning.model_count import ATTENTION, MATMUL, Op

HBM_EFFICIENCY = 0.84
"""Achievable share of HBM bandwidth for memory-bound operations."""

_SEQ_POINTS = (512, 1024, 2048, 4096, 8192, 16384)
# FlashAttention-2 forward + backward TFLOP/s at _SEQ_POINTS, head dim 128, bf16/fp16
# (causal counts half the score FLOPs, as its benchmark does).
_FA2 = {
    "a100": {False: (151, 173, 187, 196, 201, 203), True: (99, 133, 155, 173, 182, 189)},
    "h100": {False: (248, 294, 320, 326, 335, 338), True: (163, 221, 265, 294, 308, 328)},
}
_FA2_TABLES = {
    name: {causal: tuple(zip(_SEQ_POINTS, rates, strict=True)) for causal, rates in by.items()}
    for name, by in _FA2.items()
}
""":data:`_FA2` as (sequence length, TFLOP/s) points."""


TILE = (256, 128)
"""The output tile of a cuBLAS matrix multiply on tensor cores: its largest and most
efficient (NVIDIA, *Matrix Multiplication Background User's Guide*, DU-09799-001, 2023,
section 2.3), in either orientation."""

RatePoint = tuple[int, int, float]  # (smallest dimension, middle dimension, TFLOP/s)


@dataclass(frozen=True)
class Hardware:
    """One device model and the links between them, as its data sheet gives them (or as
    :meth:`measure` finds them on this machine).

    Attributes:
        peak_tflops: Dense bf16 tensor-core TFLOP/s.
        hbm_gb: Memory per GPU, GB (10^9 bytes).
        hbm_gbps: Memory bandwidth, GB/s.
        gpus_per_node: GPUs joined by NVLink in one node.
        intra_node_gbps: NVLink bandwidth per GPU, one direction, GB/s.
        inter_node_gbps: Network bandwidth per GPU, one direction, GB/s.
        matmul_tflops: Achievable matrix-multiply TFLOP/s (MAMF); default: peak x 0.85.
        attention: Which FlashAttention-2 benchmark its attention rate follows
            (``"a100"`` or ``"h100"``).
        name: The preset's name, or ``""``.
        action_overhead: Seconds the runtime adds to every F and B beyond its kernels
            (0 on a GPU, whose kernels queue while the host goes on; on a CPU
            :meth:`measure` times conveyor's own actions on a tiny pipeline,
            :func:`~conveyor.planning.machine.action_overhead`).
        sms: Streaming multiprocessors: a multiply runs in waves of one :data:`TILE`
            each (0: no wave model, every multiply at MAMF).
        launch_s: Seconds each kernel (or, on a CPU, each eager operation) adds.
        memory_efficiency: The share of ``hbm_gbps`` a memory-bound operation reaches.
        latency_s: Seconds per message between ranks (0: NCCL's latencies,
            :mod:`~conveyor.planning.collectives`).
        matmul_table: Measured multiply rates, (smallest, middle dimension, TFLOP/s),
            used instead of MAMF and waves where given.
        attention_table: Measured attention rates, (sequence length, TFLOP/s of forward
            and backward with a causal mask), used instead of ``attention`` where given.
        bandwidth_table: Measured element-wise rates, (bytes one operation moves, GB/s),
            used instead of ``hbm_gbps`` x ``memory_efficiency`` where given.
    """

    peak_tflops: float
    hbm_gb: float
    hbm_gbps: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    matmul_tflops: float = 0.0
    attention: str = "h100"
    name: str = ""
    action_overhead: float = 0.0
    sms: int = 0
    launch_s: float = 0.0
    memory_efficiency: float = HBM_EFFICIENCY
    latency_s: float = 0.0
    matmul_table: tuple[RatePoint, ...] = ()
    attention_table: tuple[tuple[int, float], ...] = ()
    bandwidth_table: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for field in ("peak_tflops", "hbm_gb", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"Hardware {field} must be a number > 0, got {value!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ConfigError(
                f"Hardware gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}"
            )
        if self.attention not in _FA2:
            raise ConfigError(
                f"Hardware attention must be one of {sorted(_FA2)}, got {self.attention!r}"
            )
        if not self.matmul_tflops:
            object.__setattr__(self, "matmul_tflops", 0.85 * self.peak_tflops)

    @classmethod
    def measure(cls, *, refresh: bool = False) -> Hardware:
        """This machine, measured once by micro-benchmarks and cached
        (:func:`conveyor.planning.machine.measure`); ``refresh`` measures again."""
        from conveyor.planning.machine import measure

        try:
            return cls(**measure(refresh=refresh))
        except (TypeError, ConfigError):  # cached by an older conveyor: measure again
            return cls(**measure(refresh=True))

    def matmul_seconds(
        self, flops: float, nbytes: float, shape: tuple[int, int, int, int] | None = None
    ) -> float:
        """Time of a matrix multiply of ``shape`` (batch, m, n, k): the longer of its FLOPs
        and its bytes. The FLOPs run at the measured rate for the shape where a table is
        given; else at MAMF, in whole waves of :data:`TILE` over ``sms`` (wave
        quantization, the same guide's section 3.2: the last wave of a multiply whose
        tiles do not fill the multiprocessors takes as long as a full one)."""
        if shape is not None and self.matmul_table:
            compute = flops / (_table_rate(self.matmul_table, shape) * 1e12)
        else:
            compute = flops / (self.matmul_tflops * 1e12)
            if shape is not None and self.sms and shape[1]:
                compute = max(compute, self._waves(shape))
        return max(compute, self.memory_seconds(nbytes)) + self.launch_s

    def _waves(self, shape: tuple[int, int, int, int]) -> float:
        batch, m, n, k = shape
        best = math.inf
        for tm, tn in (TILE, TILE[::-1]):
            tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            waves = math.ceil(tiles / self.sms)
            best = min(best, waves * self.sms * 2.0 * tm * tn * k)
        return best / (self.matmul_tflops * 1e12)

    def attention_seconds(self, flops: float, nbytes: float, seq: int, causal: bool) -> float:
        """Time of a fused attention kernel of ``flops`` (full scores) at ``seq`` tokens."""
        table = self.attention_table or _FA2_TABLES[self.attention][causal]
        rate = _attention_rate(seq, table) * 1e12
        work = flops / 2 if causal else flops
        return max(work / rate, self.memory_seconds(nbytes)) + self.launch_s

    def op_seconds(self, op: Op, share: float, tp: int, seq: int) -> float:
        """Time of ``op`` (counted for one sequence) run ``op.count`` times on ``share``
        sequences' worth of tokens, split over ``tp`` ranks; ``seq`` is the attention
        kernel's sequence length."""
        flops = op.flops * share / tp
        moved = (op.bytes * share + op.fixed_bytes) / tp
        if op.kind == MATMUL:
            seconds = self.matmul_seconds(flops, moved, _scaled(op, share, tp))
        elif op.kind == ATTENTION:
            seconds = self.attention_seconds(flops, moved, seq, op.causal)
        else:
            flat = flops / (self.peak_tflops * 1e12)
            seconds = max(flat, self.memory_seconds(moved)) + self.launch_s
        return seconds * op.count

    def memory_seconds(self, nbytes: float) -> float:
        """Time of an operation that moves ``nbytes`` through memory: at the measured
        rate of operations that size where a table is given (log-linear between sizes,
        flat beyond them), else at HBM's achievable rate."""
        if self.bandwidth_table and nbytes > 0:
            return nbytes / (_between(nbytes, self.bandwidth_table) * 1e9)
        return nbytes / (self.memory_efficiency * self.hbm_gbps * 1e9)


def _scaled(op: Op, share: float, tp: int) -> tuple[int, int, int, int] | None:
    """A multiply's shape on ``share`` sequences' tokens, its largest dimension that does
    not grow with them split over ``tp`` ranks (what tensor parallelism splits: the
    heads, the MLP's width)."""
    if not op.grows:
        return None
    dims = dict(zip(("batch", "m", "n", "k"), op.shape, strict=True))
    dims[op.grows] = max(1, round(dims[op.grows] * share))
    if tp > 1:
        fixed = ["batch"] if op.grows == "batch" else [d for d in ("m", "n", "k") if d != op.grows]
        widest = max(fixed, key=lambda d: dims[d])
        dims[widest] = max(1, -(-dims[widest] // tp))
    return dims["batch"], dims["m"], dims["n"], dims["k"]


def _table_rate(table: tuple[RatePoint, ...], shape: tuple[int, int, int, int]) -> float:
    """The measured rate nearest in (log smallest, log middle dimension)."""
    small, middle, _ = sorted(shape[1:])
    return min(
        table,
        key=lambda p: (
            (math.log2(p[0] / max(small, 1))) ** 2 + (math.log2(p[1] / max(middle, 1))) ** 2
        ),
    )[2]


def _attention_rate(seq: int, table: Sequence[tuple[float, float]]) -> float:
    """An attention benchmark's rate at ``seq`` (:func:`_between`; below its shortest
    sequence, proportionally less: less work per launch)."""
    first, rate = table[0]
    if seq <= first:
        return rate * seq / first
    return _between(seq, table)


def _between(x: float, table: Sequence[tuple[float, float]]) -> float:
    """The value at ``x`` of a table of (point, value) pairs, ascending points:
    log-linear between points, flat beyond them."""
    if x <= table[0][0]:
        return table[0][1]
    if x >= table[-1][0]:
        return table[-1][1]
    i = bisect.bisect_right(table, x, key=lambda point: point[0])
    (lo, a), (hi, b) = table[i - 1], table[i]
    return a + math.log2(x / lo) / math.log2(hi / lo) * (b - a)


LAUNCH_S = 0.9e-6
"""A kernel's cost beyond its own run when launched back to back: 3.8 us per kernel
against 2.9 us of running in NVIDIA's *Getting Started with CUDA Graphs* (A. Gray,
NVIDIA Technical Blog, 2019)."""

PRESETS: dict[str, Hardware] = {
    "a100-80g": Hardware(
        312, 80, 2039, 8, 300, 25, matmul_tflops=271.2, attention="a100", name="a100-80g",
        sms=108, launch_s=LAUNCH_S,
    ),
    "h100-sxm": Hardware(
        989, 80, 3350, 8, 450, 50, matmul_tflops=794.5, attention="h100", name="h100-sxm",
        sms=132, launch_s=LAUNCH_S,
    ),
    "h200": Hardware(
        989, 141, 4800, 8, 450, 50, matmul_tflops=794.5, attention="h100", name="h200",
        sms=132, launch_s=LAUNCH_S,
    ),
}  # fmt: skip
"""The presets (data sheets: A100 80GB SXM, H100 SXM5 80GB, H200 SXM 141GB; the network
is one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100, H200) adapter per GPU, as in a DGX;
multiprocessors: 108 on an A100, 132 on an H100 SXM5 and an H200, NVIDIA's A100 and H100
architecture white papers)."""


def hardware(spec: str | Hardware) -> Hardware:
    """``spec`` as :class:`Hardware`: a preset's name, or the object itself.

    Raises:
        ConfigError: For an unknown name.
    """
    if isinstance(spec, Hardware):
        return spec
    if spec not in PRESETS:
        raise ConfigError(
            f"unknown hardware {spec!r}; use one of {', '.join(PRESETS)} or describe it with "
            "Hardware(peak_tflops, hbm_gb, hbm_gbps, gpus_per_node, intra_node_gbps, "
            "inter_node_gbps)"
        )
    return PRESETS[spec]
