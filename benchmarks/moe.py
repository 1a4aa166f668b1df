"""Expert parallelism on CPU: step time and memory per rank of one Mixtral-style model with
its experts replicated (ep=1), sharded over 2 ranks (ep=2) without and with the overlap of
paired forward / backward actions, and DualPipeV's simulated makespan with and without
that overlap.

    python benchmarks/moe.py [--rounds 3] [--steps 3] [--warmup 1] [--json FILE]
    python benchmarks/moe.py --quick        # tiny sizes, 1 round: a smoke run

The model: a transformers ``MixtralForCausalLM`` built from a ``MixtralConfig`` (nothing
downloaded; hidden 256, 4 layers, 8 experts, top-2, expert intermediate 1024, vocabulary
1024: the experts are 93% of the parameters), built under ``conveyor.empty_weights()``
so each rank allocates and initializes only its own share. The layout: 4 processes
(forked by ``torch.multiprocessing`` from the one that runs this script, once it has
imported torch and transformers; gloo, one thread each, glibc's malloc thresholds as
``conveyor launch`` sets them), pp=2 x dp=2, the same global batch (8
sequences x 128 tokens; each replica trains on its 4 in 4 micro-batches), ``loss_fn=None``
(the model's own loss), AdamW. Three variants per schedule (1f1b, dualpipev):

- ``ep=1``: ``conveyor.init(pp=2, dp=2)``: every replica holds all 8 experts;
- ``ep=2 no overlap``: ``conveyor.init(pp=2, dp=2, ep=2)``, the schedule without its
  pairs (``conveyor.schedules.unpaired``): each rank holds 4 experts of every MoE layer
  and the tokens travel to them by all-to-all, one action at a time;
- ``ep=2 overlap``: the same with the schedule's forward / backward pairs, each run
  interleaved at the all-to-alls (``conveyor/runtime/overlap.py``).

Timing: all six runs live in the same 4 processes and alternate within every round (the
order flips every round, so drift hits all alike); each round runs ``--warmup`` untimed
and ``--steps`` timed steps of each, every step between two barriers (train step +
optimizer step); the table gives the median. Expert memory: each rank's expert
parameters (the sharded DTensors' local size; x4 with gradients and AdamW's two moments).
Peak resident memory: ``VmHWM`` of ``/proc/self/status`` on each rank, after 2 steps in
fresh processes of their own (4 forked per run, since a peak cannot be attributed in a
process running six models); it is the whole process, the interpreter, torch,
transformers and gloo included, so the table also gives the peak before the model was
built.

The simulation: ``conveyor.simulate(schedule, cost, a2a=...)`` of DualPipeV on 4 ranks
and 10 micro-batches at DeepSeek's published ratio (all-to-all time about equal to the
compute; cost (1, 1, 1), a2a 1), and on 2 ranks with the ratio measured here: in the
``ep=2 no overlap`` runs the all-to-all spans of ``pipe.last_step_waits()`` (kind ``"A"``)
are split from the actions of ``pipe.last_step_timings()`` that posted them. A span
runs from the post to the end of the transfer, so it includes waiting for the ep peer to
reach the same all-to-all: on an oversubscribed CPU that wait, not the copy, is most of it.

What 2 CPU cores can show: 4 single-threaded processes share 2 cores, so while one
micro-batch's all-to-all is in flight the other's compute competes for the same cores as
every other rank, and gloo's all-to-all on one machine is memory copies done by CPU
threads, not a transfer on its own engine. The overlap gain measured here is therefore a
lower bound and may be nil or negative (the pair's two threads and their handoffs cost
something); the simulator shows the GPU-like case, where the all-to-all runs on the
network while the SMs compute. What the table does show faithfully is the memory: ep=2
halves each rank's expert parameters, gradients and optimizer state. Note also that with
dp = ep = 2 each expert shard has one holder (``mesh["edp"]`` is 1 rank), so the ep=2 runs
all-reduce no expert gradient and step AdamW over half the experts, while ep=1 all-reduces
every expert gradient over dp: that, not the all-to-all, can make ep=2 the faster here.
The machine's other load shows as outlier steps (``--json`` keeps every step); the
median of ``--rounds`` x ``--steps`` is what the table gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import alternate, on_processes, status_kib, step_times, timing_parser  # noqa: E402

PP, DP, EP = 2, 2, 2
PROCS = PP * DP
SCHEDULES = ("1f1b", "dualpipev")
VARIANTS = ("ep=1", "ep=2 no overlap", "ep=2 overlap")
MIB = 2**20
MALLOC_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # as conveyor launch
FULL = {"hidden": 256, "layers": 4, "experts": 8, "top_k": 2, "intermediate": 1024,
        "vocab": 1024, "heads": 4, "batch": 8, "tokens": 128, "microbatches": 4}  # fmt: skip
QUICK = {"hidden": 32, "layers": 4, "experts": 8, "top_k": 2, "intermediate": 64,
         "vocab": 64, "heads": 4, "batch": 8, "tokens": 16, "microbatches": 4}  # fmt: skip
# DeepSeek-V3's report: in its training the all-to-all takes about as long as the compute.
SIM_RANKS, SIM_MICRO = 4, 10

Step = Callable[[], None]


def mixtral(shape: dict[str, int]) -> Any:
    """The benchmark model on the meta device (each rank gives its own share values)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import conveyor

    cfg = MixtralConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        max_position_embeddings=shape["tokens"], router_jitter_noise=0.0,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    with conveyor.empty_weights():
        model = MixtralForCausalLM(cfg)
    return model.train()


def model_counts(shape: dict[str, int]) -> tuple[int, int]:
    """(all parameters, expert parameters) of the model, counted on the meta device."""
    model = mixtral(shape)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, experts


def replica_batch(shape: dict[str, int], dp_rank: int) -> dict[str, Any]:
    """This replica's share of the global batch: random token ids, labels the same ids
    (the model shifts them); the same global batch in every run."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["tokens"]), generator=gen)
    rows = shape["batch"] // DP
    mine = ids[dp_rank * rows : (dp_rank + 1) * rows]
    return {"input_ids": mine, "labels": mine.clone()}


def build(
    shape: dict[str, int], schedule_name: str, variant: str, contexts: dict[int, Any]
) -> tuple[Any, Any, dict[str, Any]]:
    """(pipeline, optimizer, batch) of one run on the context of its ``ep``."""
    import torch

    import conveyor
    from conveyor.schedules import get_schedule, unpaired

    ctx = contexts[1 if variant == "ep=1" else EP]
    schedule: Any = schedule_name
    if variant == "ep=2 no overlap":
        schedule = unpaired(get_schedule(schedule_name, PP, shape["microbatches"]))
    batch = replica_batch(shape, ctx.dp_rank)
    pipe = conveyor.Pipeline(
        mixtral(shape), loss_fn=None, microbatches=shape["microbatches"], schedule=schedule,
        context=ctx, weights=None, init_seed=0, sample=(batch, None),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    return pipe, opt, batch


def expert_bytes(pipe: Any) -> tuple[int, int]:
    """(expert parameter bytes, all parameter bytes) this rank holds: local shards."""
    from conveyor.runtime.sharding import local_shard

    experts = total = 0
    for name, p in pipe.named_parameters():
        size = local_shard(p).numel() * p.element_size()
        total += size
        if ".experts." in name:  # sharded (a DTensor) with ep=2, whole with ep=1
            experts += size
    return experts, total


def a2a_split(pipe: Any) -> dict[str, float]:
    """The last step's seconds on this rank: per action kind, compute (the action's time
    less its all-to-alls) and all-to-all (the ``"A"`` spans it posted)."""
    out = {f"{what}{kind}": 0.0 for what in ("compute", "a2a") for kind in "FBW"}
    actions = pipe.last_step_timings()
    for t in actions:
        out["compute" + t.kind] += t.end - t.start
    for span in pipe.last_step_waits():
        if span.kind != "A":
            continue
        owners = [
            t for t in actions
            if (t.stage, t.microbatch) == (span.stage, span.microbatch)
            and t.start - 1e-4 <= span.start and span.end <= t.end + 1e-4
        ]  # fmt: skip
        if not owners:
            continue
        kind = owners[0].kind
        out["a2a" + kind] += span.end - span.start
        out["compute" + kind] -= span.end - span.start
    return out


def time_rank(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    """All six runs in these processes, alternated; this rank's numbers."""
    import conveyor

    contexts = {1: conveyor.init(pp=PP, dp=DP), EP: conveyor.init(pp=PP, dp=DP, ep=EP)}
    ctx = contexts[EP]
    runs: dict[tuple[str, str], Step] = {}
    splits: dict[str, list[dict[str, float]]] = {}
    memory: dict[str, tuple[int, int]] = {}
    losses: dict[str, float] = {}
    for name in args.schedules:
        for variant in VARIANTS:
            key = f"{name}/{variant}"
            pipe, opt, batch = build(shape, name, variant, contexts)
            memory[key] = expert_bytes(pipe)
            splits[key] = []

            def step(
                pipe: Any = pipe, opt: Any = opt, batch: dict[str, Any] = batch, key: str = key
            ) -> None:
                loss = pipe.train_step(batch, None)
                opt.step()
                opt.zero_grad()
                losses[key] = float(loss)
                if "ep=2" in key:
                    splits[key].append(a2a_split(pipe))

            runs[(name, variant)] = step
    times, _ = alternate(runs, None, args.rounds, step_times, args.steps, args.warmup)
    return {
        "rank": ctx.rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank,
        "ep_rank": ctx.ep_rank,
        "times": {f"{n}/{v}": t for (n, v), t in times.items()},
        "memory": memory, "losses": losses,
        "a2a_split": {
            key: {k: statistics.median(s[k] for s in parts) for k in parts[0]}
            for key, parts in splits.items() if parts
        },
    }  # fmt: skip


def memory_rank(args: argparse.Namespace, shape: dict[str, int], key: str) -> dict[str, Any]:
    """One run in fresh processes: this rank's peak resident memory after 2 steps."""
    import conveyor

    name, variant = key.split("/")
    ep = 1 if variant == "ep=1" else EP
    ctx = conveyor.init(pp=PP, dp=DP, ep=ep)
    before = status_kib("VmHWM")  # the interpreter, torch, transformers, the process group
    pipe, opt, batch = build(shape, name, variant, {ep: ctx})
    for _ in range(2):
        pipe.train_step(batch, None)
        opt.step()
        opt.zero_grad()
    return {"rank": ctx.rank, "before": before * 1024, "peak": status_kib("VmHWM") * 1024}


def simulations(measured: dict[str, float] | None, micro: int) -> list[dict[str, Any]]:
    """DualPipeV's makespan with and without its pairs: at DeepSeek's ratio on 4 ranks,
    and on 2 ranks with ``measured`` compute and all-to-all (seconds per micro-batch through
    one rank's share: ``computeF``, ``a2aF``, ...)."""
    from conveyor.schedules import get_schedule, unpaired
    from conveyor.simulate import simulate

    cases: list[tuple[str, int, int, tuple[float, float, float], tuple[float, float]]] = [
        ("a2a = compute (DeepSeek)", SIM_RANKS, SIM_MICRO, (1.0, 1.0, 1.0), (1.0, 1.0)),
        ("a2a = compute (DeepSeek)", PP, micro, (1.0, 1.0, 1.0), (1.0, 1.0)),
    ]
    if measured is not None:
        # W alone: its all-to-all (the split backward re-runs the combine) counts as its
        # time, since the simulator gives W none.
        cost = (measured["computeF"], measured["computeB"],
                measured["computeW"] + measured["a2aW"])  # fmt: skip
        cases.append(("measured here", PP, micro, cost, (measured["a2aF"], measured["a2aB"])))
    out = []
    for what, ranks, m, cost, a2a in cases:
        schedule = get_schedule("dualpipev", ranks, m)
        paired = simulate(schedule, cost=cost, a2a=a2a)
        alone = simulate(unpaired(schedule), cost=cost, a2a=a2a)
        out.append({
            "case": what, "ranks": ranks, "microbatches": m, "cost": list(cost),
            "a2a": list(a2a), "ratio": sum(a2a) / (cost[0] + cost[1]),
            "makespan_overlap": paired.makespan, "makespan_no_overlap": alone.makespan,
            "pairs": paired.overlapped,
        })  # fmt: skip
    return out


def ranks_cell(values: list[float], fmt: str = "{:.1f}") -> str:
    """Per-rank values as ``a / b / c / d``."""
    return " / ".join(fmt.format(v) for v in values)


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, run the phases on 4 processes and print the tables."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = timing_parser(__doc__, rounds=3)
    p.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated (default: %(default)s)"
    )
    args = p.parse_args(argv)
    args.schedules = args.schedules.split(",")
    if args.quick:
        args.rounds, args.steps = 1, 1
    # As `conveyor launch` does for its workers: one thread per process, and glibc keeps
    # freed buffers for the next step. glibc reads these at start: set them, start again.
    wanted = {"OMP_NUM_THREADS": "1", **{k: str(1 << 30) for k in MALLOC_TUNABLES}}
    if any(k not in os.environ for k in wanted):
        os.environ.update({k: os.environ.get(k, v) for k, v in wanted.items()})
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv])
    # Imported once here, before the processes are forked from this one.
    import torch
    import transformers  # noqa: F401

    import conveyor  # noqa: F401

    torch.set_num_threads(1)
    shape = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    timing = on_processes(PROCS, time_rank, args, shape)
    timed_s = time.perf_counter() - t0
    peaks = {
        f"{name}/{variant}": on_processes(PROCS, memory_rank, args, shape, f"{name}/{variant}")
        for name in args.schedules
        for variant in VARIANTS
    }
    seconds = time.perf_counter() - t0

    total, experts = model_counts(shape)
    m = shape["microbatches"]
    print(
        f"\nMixtral from a config: hidden {shape['hidden']}, {shape['layers']} layers, "
        f"{shape['experts']} experts top-{shape['top_k']}, expert intermediate "
        f"{shape['intermediate']}, vocabulary {shape['vocab']}: {total / 1e6:.2f}M "
        f"parameters, experts {100 * experts / total:.0f}%. Global batch {shape['batch']} x "
        f"{shape['tokens']} tokens, pp={PP} x dp={DP} ({PROCS} processes x 1 thread, gloo), "
        f"{m} micro-batches per replica, AdamW; median of {args.rounds} rounds x "
        f"{args.steps} steps ({args.warmup} warm-up per run per round); {seconds:.0f} s in "
        f"all, {timed_s:.0f} s of it the timed processes. Per rank (ranks 0..3 = (pp, dp) "
        f"(0,0) (1,0) (0,1) (1,1)): expert parameters (local shards), and peak resident "
        f"memory (VmHWM, the whole process) after 2 steps in fresh processes, beside its "
        f"value before the model was built.\n"
    )
    print(
        "| schedule | variant | step ms | vs ep=1 | expert params MiB per rank "
        "| VmHWM MiB per rank | before the model |"
    )
    print("|---|---|---:|---:|---|---|---|")
    rows = []
    for name in args.schedules:
        base = 0.0
        for variant in VARIANTS:
            key = f"{name}/{variant}"
            # A step's time is the slowest rank's; the barriers make them all alike.
            per_step = [max(ts) for ts in zip(*(r["times"][key] for r in timing), strict=True)]
            median = statistics.median(per_step)
            base = base or median
            expert_mib = [r["memory"][key][0] / MIB for r in timing]
            peak_mib = [r["peak"] / MIB for r in peaks[key]]
            before_mib = [r["before"] / MIB for r in peaks[key]]
            print(
                f"| {name} | {variant} | {median * 1e3:.0f} | {median / base:.2f} | "
                f"{ranks_cell(expert_mib)} | {ranks_cell(peak_mib, '{:.0f}')} | "
                f"{ranks_cell(before_mib, '{:.0f}')} |"
            )
            rows.append({
                "schedule": name, "variant": variant, "step_ms": median * 1e3,
                "ratio_to_ep1": median / base,
                "step_ms_all": [t * 1e3 for t in per_step],
                "expert_param_bytes": [r["memory"][key][0] for r in timing],
                "param_bytes": [r["memory"][key][1] for r in timing],
                "vmhwm_bytes": [r["peak"] for r in peaks[key]],
                "vmhwm_before_model_bytes": [r["before"] for r in peaks[key]],
                "loss": [r["losses"].get(key) for r in timing],
            })  # fmt: skip

    # The measured all-to-all against compute: the dualpipev run without pairs, mean over
    # the ranks, per micro-batch through one rank's share (both its stages).
    print(
        "\nAll-to-all against compute, ms per rank per micro-batch (median step, ranks "
        "0..3), from the actions (pipe.last_step_timings()) and the all-to-all spans "
        "(kind A of pipe.last_step_waits()) they posted:\n"
    )
    print("| run | F compute | F all-to-all | B compute | B all-to-all | W compute "
          "| W all-to-all |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    splits: dict[str, dict[str, float]] = {}
    for name in args.schedules:
        for variant in VARIANTS[1:]:
            key = f"{name}/{variant}"
            parts = [r["a2a_split"][key] for r in timing]
            cells = [
                ranks_cell([part[f] / m * 1e3 for part in parts], "{:.2f}")
                for f in ("computeF", "a2aF", "computeB", "a2aB", "computeW", "a2aW")
            ]
            print(f"| {key} | " + " | ".join(cells) + " |")
            splits[key] = {f: statistics.mean(part[f] / m for part in parts) for f in parts[0]}
    measured = splits.get("dualpipev/ep=2 no overlap")
    sims = simulations(measured, m)
    print("\nSimulated DualPipeV makespan (conveyor.simulate, a2a= the all-to-all time):\n")
    for sim in sims:
        unit = "" if sim["case"].startswith("a2a") else " ms"
        scale = 1.0 if not unit else 1e3
        print(
            f"- dualpipev p={sim['ranks']} m={sim['microbatches']}, {sim['case']} "
            f"(a2a / compute = {sim['ratio']:.2f}): makespan "
            f"{sim['makespan_overlap'] * scale:.4g}{unit} with overlap, "
            f"{sim['makespan_no_overlap'] * scale:.4g}{unit} without "
            f"({sim['makespan_no_overlap'] / sim['makespan_overlap']:.2f} x)"
        )
    if measured is not None and measured["a2aW"] > 0:
        print(
            "  (measured: W's all-to-all, re-run in the split backward, is added to W's "
            "compute, as the simulator gives W none)"
        )
    if args.json:
        import torch

        report = {
            "model": {"parameters": total, "expert_parameters": experts, **shape},
            "processes": PROCS, "pp": PP, "dp": DP, "ep": EP, "threads": 1,
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "torch": torch.__version__, "seconds": seconds, "rows": rows,
            "a2a_split_ms_per_microbatch": {
                key: {f: v * 1e3 for f, v in split.items()} for key, split in splits.items()
            },
            "simulations": sims,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
