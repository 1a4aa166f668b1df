"""What a split backward holds between B and W, and the peak that follows, per schedule.

Two parts, both measured with the runtime's own activation meter (``track_memory=True``:
the bytes autograd saves for the backward, and what B keeps for W, held while alive):

1. One layer (``--layers``): a transformers Llama decoder layer (hidden 256, sequence
   128, fp32) and a GPT layer of each of the Zero Bubble paper's four shapes (its Table
   3: hidden, heads, sequence 1024) scaled down by 8 in hidden size and sequence (the
   heads kept, so the paper's M_W / M_B stays the same), in bfloat16 as the paper counts:
   what F saved, what is held from B to W, what W reads (the inputs and output gradients
   of the layer's GEMMs, counted from the shapes) and the paper's M_W.
2. A pipeline on 4 processes (gloo, one thread each) with 8 micro-batches: a transformers
   Llama (8 layers of hidden 256, sequence 128, one sequence per micro-batch) and the
   vs_torch model (8 x Linear(1024, 1024) + ReLU, batch 64): per schedule, the bytes held
   between B and W per micro-batch, the most any rank holds (``peak``), the peak the
   schedule's memory model predicts with the measured share, and the median step time.
   ``--before PATH`` runs the same in another checkout of conveyor (e.g. the commit
   before this change, ``git archive 1445be3 | tar -x -C /tmp/before``), alternated with
   this one round by round, so the two columns come from one run.

    python benchmarks/split_backward_memory.py --layers
    python benchmarks/split_backward_memory.py [--model llama|mlp] [--before PATH] [--rounds 2]
    python benchmarks/split_backward_memory.py --model flush [--before PATH]

3. ``--model flush``: W's own spike, 8 micro-batches of a stage run together (a schedule's
   run of W's): the most bytes alive at once during W beyond what was held for it. Before
   this change W joined every micro-batch's X and dY into one copy per weight for one
   GEMM; now each micro-batch adds into ``.grad`` in place and is freed as it goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MARK = "RESULT "
RANKS, MICROBATCHES = 4, 8
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zbv", "zb-auto")  # zb-auto: chunks 1, a cap of 2p
PAPER_SHAPES = {  # the paper's Table 3: hidden, heads (sequence 1024)
    "1.5B": (2304, 24),
    "6.2B": (4096, 64),
    "14.6B": (5120, 40),
    "28.3B": (6144, 48),
}
SCALE = 8


def _import_tree(tree: str | None) -> None:
    """Put ``tree`` (a conveyor checkout; None: this one) first on the import path."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, tree or str(HERE.parent))


# ------------------------------------------------------------------------------ one layer
def paper_layer(width: int, heads: int) -> Any:
    """A GPT layer as the Zero Bubble paper counts it (its Table 1, after Korthikanti et
    al.): layer norm, fused q/k/v, attention scores with softmax and dropout, projection,
    an MLP of 4 h with GeLU, dropout after both, residuals."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, h = x.shape
            shape = (b, s, heads, h // heads)
            q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // heads)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), 0.1)
            x = x + F.dropout(self.proj((att @ v).transpose(1, 2).reshape(b, s, h)), 0.1)
            return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.1)

    return Layer()


def held_by_layer(layer: Any, x: Any, call: Any = None) -> tuple[int, int]:
    """(bytes F saved, bytes held from B until W) of one micro-batch through ``layer``,
    run as a stage of a split-backward schedule runs it."""
    import torch

    from conveyor.runtime.deferred_linear import LinearWeightStore
    from conveyor.runtime.memory import ActivationMeter
    from conveyor.runtime.split_backward import backward_input

    params = [p for p in layer.parameters() if p.requires_grad]
    store, meter = LinearWeightStore(params), ActivationMeter(params)
    with meter.hooks(), store.capture((0, 0)):
        out = (call or layer)(x)
    saved = meter.current
    backward_input([out], [torch.randn_like(out)], [x])
    del out
    meter.track(store.kept((0, 0)))
    held = meter.current
    store.flush([(0, 0)])
    return saved, held


def paper_share(name: str) -> tuple[int, int, int]:
    """(F saved, held from B to W, the paper's M_W) in bytes of one micro-batch through a
    GPT layer of the paper's shape ``name``, scaled down (module doc)."""
    import torch

    hidden, heads = PAPER_SHAPES[name]
    width, seq = hidden // SCALE, 1024 // SCALE
    torch.manual_seed(0)
    layer = paper_layer(width, heads).to(torch.bfloat16)
    x = torch.randn(1, seq, width, dtype=torch.bfloat16, requires_grad=True)
    saved, held = held_by_layer(layer, x)
    return saved, held, 32 * seq * width  # M_W = 32 sbh bytes (16 values in 16-bit)


def llama_layer() -> tuple[int, int, int]:
    """(F saved, held from B to W, what W reads) of a transformers Llama decoder layer."""
    import torch
    import transformers as T

    hidden, inter, seq = 256, 688, 128
    torch.manual_seed(0)
    config = T.LlamaConfig(num_hidden_layers=1, hidden_size=hidden, intermediate_size=inter,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                           max_position_embeddings=seq)  # fmt: skip
    model = T.LlamaForCausalLM(config)
    layer = model.model.layers[0]
    x = torch.randn(1, seq, hidden, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(seq)[None])

    def call(h: torch.Tensor) -> torch.Tensor:
        out = layer(h, position_embeddings=rotary, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    saved, held = held_by_layer(layer, x, call)
    # X of q/k/v (one), o, gate/up (one), down; dY of q, k, v, o, gate, up, down.
    values = 3 * hidden + inter + 3 * hidden + hidden + 2 * inter + hidden
    return saved, held, seq * values * 4


def layers_table() -> str:
    rows = ["| layer | F saved (KB) | held B→W (KB) | W reads (KB) | held / W reads "
            "| held / F saved |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    shapes = [("Llama, transformers (h 256, s 128, fp32)", llama_layer())]
    for name in PAPER_SHAPES:
        h, a = PAPER_SHAPES[name]
        shapes.append((f"GPT {name} / 8 (h {h // SCALE}, a {a}, s 128, bf16)", paper_share(name)))
    for label, (saved, held, reads) in shapes:
        rows.append(f"| {label} | {saved / 1e3:.0f} | {held / 1e3:.0f} | {reads / 1e3:.0f} "
                    f"| {held / reads:.3f} | {held / saved:.3f} |")  # fmt: skip
    return "\n".join(rows)


# ------------------------------------------------------------------------------ W's spike
def flush_spike() -> dict[str, int]:
    """W of 8 micro-batches of one stage (4 x Linear(512, 512) + GELU, 64 rows each) run
    together, as a schedule's run of W's is: the bytes held for W before it, and the most
    bytes of tensors alive at once during it beyond those (:class:`TensorMemory`).
    Adapts to the split backward's API before this change (``backward_input`` with the
    parameters, returning W's work) so that ``--before`` measures the old W too."""
    import inspect

    import torch
    from torch import nn

    from conveyor.runtime.deferred_linear import LinearWeightStore
    from conveyor.runtime.memory import TensorMemory
    from conveyor.runtime.split_backward import backward_input

    torch.manual_seed(0)
    stage = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.GELU())])
    params = list(stage.parameters())
    store = LinearWeightStore(params)
    old = "params" in inspect.signature(backward_input).parameters
    keys = [(0, m) for m in range(MICROBATCHES)]
    works = []
    for key in keys:
        x = torch.randn(64, 512, requires_grad=True)
        with store.capture(key):
            out = stage(x)
        if old:
            works.append(backward_input([out], [torch.ones_like(out)], [x], params)[1])
        else:
            backward_input([out], [torch.ones_like(out)], [x])
        del out, x
    stage.zero_grad()
    kept = sum(t.numel() * t.element_size() for key in keys for t in store.kept(key))
    with TensorMemory() as memory:  # .grad (made here) and every temporary of W
        for work in works:
            work.run()
        works.clear()
        store.flush(keys)
    grads = sum(p.numel() * p.element_size() for p in params)
    return {"kept": kept, "peak": memory.peak, "grads": grads}


# ------------------------------------------------------------------------------- pipeline
def _llama() -> tuple[Any, Any, Any]:
    import torch
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=688,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                           max_position_embeddings=128, use_cache=False, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0)  # fmt: skip
    ids = torch.randint(1, 512, (MICROBATCHES, 128), generator=torch.Generator().manual_seed(1))
    return T.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}, None


def _mlp() -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)


def _worker(model_name: str, steps: int) -> dict[str, Any]:
    """On one of the processes: every schedule's memory report and step times."""
    import torch.distributed as dist
    from torch import nn

    import conveyor
    from conveyor.schedules import get_schedule, zero_bubble_auto
    from conveyor.simulate import peak_activations

    ctx = conveyor.init(pp=RANKS)
    rank = ctx.pp_rank
    out: dict[str, Any] = {}
    share: float | None = None
    for name in SCHEDULES:
        chunks = 2 if name == "zbv" else 1
        schedule: Any = get_schedule(name, RANKS, MICROBATCHES, chunks)
        if name == "zb-auto":  # at 2p, told the share zb-h1 measured (before: counted whole)
            kw = {"w_memory": min(share, 1.0)} if share is not None else {"w_memory": 1.0}
            schedule = zero_bubble_auto(RANKS, MICROBATCHES, microbatch_cap=2 * RANKS, **kw)
        pipes = []
        for track in (True, False):  # measured with the meter; timed without its hooks
            model, x, y = (_llama if model_name == "llama" else _mlp)()
            loss = nn.functional.mse_loss if y is not None else None
            pipes.append(conveyor.Pipeline(model, loss_fn=loss, microbatches=MICROBATCHES,
                         schedule=schedule, context=ctx, track_memory=track))  # fmt: skip
        for _ in range(2):
            pipes[0].train_step(x, y)
        report = pipes[0].last_step_memory()
        held = {k: report.forward[k] + v for k, v in report.at_backward.items()}
        mine = sum(held.values()) / sum(report.forward[k] for k in held) if held else None
        if name == "zb-h1":
            shares: list[Any] = [None] * RANKS
            dist.all_gather_object(shares, mine)
            share = max(shares)
        forward = statistics.mean(report.forward.values())
        model_peak = None
        if chunks == 1:  # the schedule's model in micro-batches, with this rank's share
            w = min(mine, 1.0) if mine is not None else 1.0
            model_peak = peak_activations(schedule, w_memory=w)[rank] * forward
        times = []
        pipes[1].train_step(x, y)
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            pipes[1].train_step(x, y)
            times.append(time.perf_counter() - start)
        out[name] = {
            "peak": report.peak,
            "simulated": report.simulated_peak,
            "model": model_peak,
            "forward": forward,
            "held": statistics.mean(held.values()) if held else None,
            "share": mine,
            "time": statistics.median(times) if times else None,
        }
    return out


def worker_main(tree: str | None, model_name: str, steps: int) -> None:
    """In a subprocess on ``tree``: fork the processes (or, for ``flush``, measure W's
    spike here), print their results as JSON."""
    _import_tree(tree)
    if model_name == "flush":
        print(MARK + json.dumps(flush_spike()), flush=True)
        return
    from common import on_processes

    results = on_processes(RANKS, _worker, model_name, steps)
    print(MARK + json.dumps(results), flush=True)


def _run_tree(tree: str, model: str, steps: int) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    argv = [sys.executable, __file__, "--worker", "--tree", tree, "--model", model,
            "--steps", str(steps)]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def pipeline_table(model: str, trees: dict[str, str], rounds: int, steps: int) -> str:
    """The table of one model: per schedule and tree, held bytes, peaks and step time."""
    runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in trees}
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for label in order:
            runs[label].append(_run_tree(trees[label], model, steps))
    rows = ["| schedule | runtime | held B→W per micro-batch (MB) | F saved per micro-batch "
            "(MB) | peak, most of any rank (MB) | vs 1f1b | peak / model | step (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in SCHEDULES:
        for label in trees:
            first = runs[label][0]  # memory is deterministic: the first round's
            peak = max(rank[name]["peak"] for rank in first)
            base = max(rank["1f1b"]["peak"] for rank in first)
            helds = [rank[name]["held"] for rank in first if rank[name]["held"] is not None]
            held = f"{max(helds) / 1e6:.2f}" if helds else "—"
            fwd = max(rank[name]["forward"] for rank in first) / 1e6
            times = [max(rank[name]["time"] for rank in run) for run in runs[label]]
            models = [rank[name]["model"] for rank in first]
            fit = "—"  # measured over the schedule's model with the measured share
            if None not in models:
                fit = f"{max(r[name]['peak'] / m for r, m in zip(first, models, strict=True)):.3f}"
            time_s = statistics.median(times)
            rows.append(f"| {name} | {label} | {held} | {fwd:.2f} | {peak / 1e6:.2f} "
                        f"| {peak / base:.2f} | {fit} | {time_s:.3f} |")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", action="store_true", help="the one-layer table only")
    ap.add_argument("--model", choices=("llama", "mlp", "both", "flush"), default="both")
    ap.add_argument("--before", help="another conveyor checkout to run alternated with this")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.tree, args.model, args.steps)
        return 0
    _import_tree(None)
    if args.layers:
        print(layers_table())
        return 0
    trees = {"this": str(HERE.parent)}
    if args.before:
        trees = {"before": str(Path(args.before).resolve()), **trees}
    if args.model == "flush":
        print("| runtime | held for W (MB) | W's peak beyond it (MB) | of which .grad (MB) |")
        print("|---|---:|---:|---:|")
        for label, tree in trees.items():
            got = _run_tree(tree, "flush", 0)
            print(f"| {label} | {got['kept'] / 1e6:.2f} | {got['peak'] / 1e6:.2f} "
                  f"| {got['grads'] / 1e6:.2f} |")  # fmt: skip
        return 0
    for model in ("llama", "mlp") if args.model == "both" else (args.model,):
        print(f"\n{model}, pp {RANKS}, {MICROBATCHES} micro-batches\n")
        print(pipeline_table(model, trees, args.rounds, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
