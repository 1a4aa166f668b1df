"""Context parallelism on CPU: activation memory, peak resident memory and step time per
rank of a transformers Llama at a long sequence, with the sequence cut over cp = 1, 2 and
4 ranks of each of 2 pipeline ranks, and the ring beside the all-gather.

    python benchmarks/context_parallel.py [--seq 8192] [--steps 2] [--json FILE]
    python benchmarks/context_parallel.py --quick      # a short sequence: a smoke run

The model: a ``LlamaForCausalLM`` built from its config (hidden 64, 4 layers, 4 heads of
16, intermediate 128, vocabulary 512; as many key/value heads as heads, so that without
cp transformers' ``sdpa`` runs torch's CPU flash kernel, which keeps no scores: with
grouped-query heads it falls back to the math kernel, which keeps ``S x S`` scores per
head), its own token loss
(``loss_fn=None``), AdamW; a batch of 2 sequences of ``--seq`` tokens in 2 micro-batches,
1F1B over pp = 2. Each layout runs in fresh processes of its own (forked from this one:
gloo, one thread each): pp 2 (2 processes), pp 2 x cp 2 (4), pp 2 x cp 4 (8).

Per rank: the peak of the activation memory the step holds (``track_memory=True``: the
tensors autograd saves, measured by the runtime's meter: deterministic), ``VmHWM`` (the
peak resident set of the whole process after the steps: interpreter, torch and the model
included), and seconds per training step (the median; 4-8 busy processes on 2 cores
share the cores, so compare the ring with the all-gather at the same cp, measured in the
same processes one after the other, not one cp with another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import on_processes, status_kib


def llama(seq: int) -> Any:
    import torch
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=512, max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    return T.LlamaForCausalLM(config)


def run(cp: int, seq: int, steps: int, strategies: list[str]) -> dict[str, Any]:
    """One rank of pp 2 x cp ``cp``: per strategy its activation peak and step times."""
    import torch
    import torch.distributed as dist

    import conveyor

    ctx = conveyor.init(pp=2, cp=cp)
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    out: dict[str, Any] = {"rank": ctx.rank, "pp": ctx.pp_rank, "cp": ctx.cp_rank}
    for strategy in strategies:
        pipe = conveyor.Pipeline(llama(seq), loss_fn=None, microbatches=2,
                                 track_memory=True, cp_attention=strategy)  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        times, peaks = [], []
        for _ in range(steps + 1):  # the first step captures the model and learns shapes
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(batch)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - t0)
            report = pipe.last_step_memory()
            assert report is not None
            peaks.append(report.peak)
        out[strategy] = {"seconds": statistics.median(times[1:]), "activations": max(peaks)}
    out["vmhwm_mib"] = status_kib("VmHWM") / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run")
    p.add_argument("--cp", default="1,2,4", help="cp sizes to run")
    p.add_argument("--quick", action="store_true", help="a short sequence, one step")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.steps = 256, 1
    import transformers  # noqa: F401  (imported once, before the processes fork)

    rows = []
    for cp in (int(c) for c in args.cp.split(",")):
        strategies = ["ring"] if cp == 1 else ["ring", "all-gather"]
        results = on_processes(2 * cp, run, cp, args.seq, args.steps, strategies)
        for r in results:
            r["cp_size"] = cp
        rows += results
        act = max(r["ring"]["activations"] for r in results) / 2**20
        rss = max(r["vmhwm_mib"] for r in results)
        times = " ".join(f"{s} {results[0][s]['seconds']:.2f} s" for s in strategies)
        print(f"cp {cp}: activations at most {act:.1f} MiB per rank, VmHWM at most "
              f"{rss:.0f} MiB, step {times}", flush=True)  # fmt: skip
    print()
    print("| cp | processes | activation peak per rank (MiB) | VmHWM per rank (MiB) | "
          "step, ring (s) | step, all-gather (s) |")  # fmt: skip
    print("|---:|---:|---|---|---:|---:|")
    for cp in sorted({r["cp_size"] for r in rows}):
        ranks = sorted((r for r in rows if r["cp_size"] == cp), key=lambda r: r["rank"])
        act = ", ".join(f"{r['ring']['activations'] / 2**20:.1f}" for r in ranks)
        rss = ", ".join(f"{r['vmhwm_mib']:.0f}" for r in ranks)
        ring = ranks[0]["ring"]["seconds"]
        gather = ranks[0].get("all-gather", {}).get("seconds")
        gathered = f"{gather:.2f}" if gather is not None else "—"
        print(f"| {cp} | {2 * cp} | {act} | {rss} | {ring:.2f} | {gathered} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
