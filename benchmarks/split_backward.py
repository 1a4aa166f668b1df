"""Cost of splitting a backward into B (input gradients) and W (weight gradients).

One stage of the benchmark model (4 x Linear(1024, 1024) + ReLU, a micro-batch of 8 rows,
its input requiring a gradient as on every stage but the first), one thread, through the
runtime's path: linear layers' weight gradients deferred to W, the rest split by autograd. Blocks of
ordinary backwards and of B + W alternate (single calls alternating would measure each
evicting the other's 32 MB of weights and gradients from cache); medians are printed.

``--compiled``: the same stage compiled as ``Pipeline(compile=True)`` compiles it (inductor,
per layer), B + W of the compiled stage against one backward of the same compiled stage
without the split (its linears inside the compiled graphs).

``--layer gpt``: a GPT layer as the Zero Bubble paper counts it (hidden 512, 8 heads,
sequence 256, dropout on; ``split_backward_memory.paper_layer``) instead: B also holds the
attention core's backward and the norms' weight gradients, W the six weight GEMMs; the
schedules assume B and W take about as long.

    python benchmarks/split_backward.py [--repeats 100] [--compiled] [--layer mlp|gpt]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from conveyor.partition.sequential import SequentialStage
from conveyor.runtime.compiled import compile_stages
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.split_backward import backward_input

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split_backward_memory import paper_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--compiled", action="store_true", help="compiled stages (inductor)")
    ap.add_argument("--layer", choices=("mlp", "gpt"), default="mlp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = [m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    shape: tuple[int, ...] = (8, 1024)
    if args.layer == "gpt":
        layers, shape = [paper_layer(512, 8)], (1, 256, 512)
    stage: nn.Module = nn.Sequential(*layers)
    split_stage = stage
    if args.compiled:  # two compiled copies of the same layers: with and without the split
        stage = SequentialStage(*layers)
        split_stage = SequentialStage(*copy.deepcopy(layers))
        compile_stages({0: stage}, {})
        compile_stages({0: split_stage}, {})
    params = list(split_stage.parameters())
    x = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)

    def ordinary() -> float:
        out = stage(x)
        t = time.perf_counter()
        out.backward(g)
        return time.perf_counter() - t

    store = LinearWeightStore(params, opaque=args.compiled)

    def split() -> tuple[float, float]:
        with store.capture((0, 0)):
            out = split_stage(x)
        t = time.perf_counter()
        backward_input([out], [g], [x], lambda keep: store.collecting((0, 0) if keep else None))
        b = time.perf_counter()
        store.flush([(0, 0)])
        return b - t, time.perf_counter() - b

    full: list[float] = []
    bs: list[float] = []
    ws: list[float] = []
    block = 10
    for i in range(args.repeats // block + 1):
        for _ in range(block):
            f = ordinary()
            if i:
                full.append(f)
        for _ in range(block):
            b, w = split()
            if i:
                bs.append(b)
                ws.append(w)
    f, b, w = (statistics.median(v) * 1e3 for v in (full, bs, ws))
    what = "compiled (inductor) " if args.compiled else ""
    print(
        f"{what}{args.layer}: ordinary backward {f:.2f} ms | B {b:.2f} ms + W {w:.2f} ms = "
        f"{b + w:.2f} ms ({(b + w) / f:.3f} of ordinary; B / W {b / w:.2f})"
    )


if __name__ == "__main__":
    main()
