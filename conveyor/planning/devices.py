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
  coalesced-load ceiling on H100 (the one measurement found; NVIDIA claims 0.95 for A100).
"""

from __future__ import annotations

import bisect
import math
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


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the links between them, as its data sheet gives them.

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
            (0 on a GPU, whose kernels queue while the host goes on).
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

    def matmul_seconds(self, flops: float, nbytes: float) -> float:
        """Time of a matrix multiply: the longer of its FLOPs at MAMF and its bytes."""
        return max(flops / (self.matmul_tflops * 1e12), self.memory_seconds(nbytes))

    def attention_seconds(self, flops: float, nbytes: float, seq: int, causal: bool) -> float:
        """Time of a fused attention kernel of ``flops`` (full scores) at ``seq`` tokens."""
        rate = _interpolate(seq, _FA2[self.attention][causal]) * 1e12
        work = flops / 2 if causal else flops
        return max(work / rate, self.memory_seconds(nbytes))

    def op_seconds(self, op: Op, share: float, tp: int, seq: int) -> float:
        """Time of ``op`` (counted for one sequence) run ``op.count`` times on ``share``
        sequences' worth of tokens, split over ``tp`` ranks; ``seq`` is the attention
        kernel's sequence length."""
        flops = op.flops * share / tp
        moved = (op.bytes * share + op.fixed_bytes) / tp
        if op.kind == MATMUL:
            seconds = self.matmul_seconds(flops, moved)
        elif op.kind == ATTENTION:
            seconds = self.attention_seconds(flops, moved, seq, op.causal)
        else:
            seconds = max(flops / (self.peak_tflops * 1e12), self.memory_seconds(moved))
        return seconds * op.count

    def memory_seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` through HBM at its achievable rate."""
        return nbytes / (HBM_EFFICIENCY * self.hbm_gbps * 1e9)


def _interpolate(seq: int, rates: tuple[int, ...]) -> float:
    """The benchmark's rate at ``seq``: log-linear between points, flat beyond them."""
    if seq <= _SEQ_POINTS[0]:
        return rates[0] * seq / _SEQ_POINTS[0]  # shorter rows: proportionally less work per launch
    if seq >= _SEQ_POINTS[-1]:
        return float(rates[-1])
    i = bisect.bisect_right(_SEQ_POINTS, seq)
    lo, hi = _SEQ_POINTS[i - 1], _SEQ_POINTS[i]
    t = math.log2(seq / lo) / math.log2(hi / lo)
    return rates[i - 1] + t * (rates[i] - rates[i - 1])


PRESETS: dict[str, Hardware] = {
    "a100-80g": Hardware(
        312, 80, 2039, 8, 300, 25, matmul_tflops=271.2, attention="a100", name="a100-80g"
    ),
    "h100-sxm": Hardware(
        989, 80, 3350, 8, 450, 50, matmul_tflops=794.5, attention="h100", name="h100-sxm"
    ),
    "h200": Hardware(
        989, 141, 4800, 8, 450, 50, matmul_tflops=794.5, attention="h100", name="h200"
    ),
}
"""The presets (data sheets: A100 80GB SXM, H100 SXM5 80GB, H200 SXM 141GB; the network
is one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100, H200) adapter per GPU, as in a DGX)."""


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
