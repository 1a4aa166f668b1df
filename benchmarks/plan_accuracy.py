"""How well ``conveyor.plan`` predicts a real step, and whether time balance beats
parameter balance, on 2 processes (gloo, one thread each).

Models: the benchmark model of ``vs_torch.py`` (8 x Linear(1024) + ReLU, batch 64, MSE)
and an unbalanced one (small Linears on 64 tokens per sample, then a large head once per
sample: parameter counts say little about time). For each: plan on both ranks (with its
calibration run), then measure the chosen configuration independently in a fresh
``Pipeline`` and print predicted vs measured median step (no optimizer step; the planner
does not count it). For the unbalanced model the same schedule also runs with the
parameter-balanced split (``balance=None``).

    python benchmarks/plan_accuracy.py [--steps 10] [--rounds 3] [--warmup 3] [--microbatches 8]
        [--recompute] [--autocast] [--meta]
    python benchmarks/plan_accuracy.py --counted [--steps 3] [--rounds 3] [--warmup 2]

``--recompute`` / ``--autocast`` (bf16) plan and run with those options: the planner's
calibration runs the pipeline's own step, so its prediction should stay as close.
``--meta`` also plans the same model built under ``conveyor.empty_weights()`` (each unit
timed on a real copy of it alone, calibration on each rank's own stages) and measures that
plan in a ``Pipeline`` of a meta model: its choice and prediction beside the real model's.

``--counted`` checks the other source instead: ``conveyor.planning.estimate`` against
``Hardware.measure()`` beside the real step of a transformers Llama on every layout two
processes can run here, and names the issue's layouts it cannot run
(``benchmarks/counted_accuracy.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from common import run_on_processes, step_times

import conveyor
from conveyor._options import Options
from conveyor.observe.trace import measured_costs
from conveyor.planning.planner import Plan, plan
from conveyor.planning.profiler import profile
from conveyor.runtime.timing import Timing
from conveyor.schedules import Schedule
from conveyor.simulate import simulate

BATCH, PROCS = 64, 2
TOKENS, WIDTH, TOKEN_LAYERS = 64, 128, 12  # the unbalanced model's input: BATCH x TOKENS x WIDTH
TIMINGS: list[Timing] = []  # action timings of the planned runs, for the replay


def benchmark_model() -> tuple[nn.Sequential, int, int]:
    """8 x (Linear(1024), ReLU), input and output width."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), 1024, 1024


class MeanOverTokens(nn.Module):
    """(batch, tokens, features) -> (batch, features)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def unbalanced_model() -> tuple[nn.Sequential, int, int]:
    """Parameters and time disagree: twelve Linear(128, 128) (16 K parameters each) run on
    all 64 tokens of every sample, then a head of 1.3 M parameters runs once per sample.
    Per parameter the token layers cost 64x more, so the parameter-balanced split puts
    all of them on one stage."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(TOKEN_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers += [
        MeanOverTokens(),
        nn.Linear(WIDTH, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 64),
    ]
    return nn.Sequential(*layers), WIDTH, 64


def median_step(step: Callable[[], None], steps: int, warmup: int) -> float:
    """Median seconds of ``step`` between barriers, after ``warmup`` untimed steps."""
    return statistics.median(step_times(step, steps, warmup))


def pipeline_step(
    model: nn.Module | Callable[[], nn.Module],
    x: Tensor,
    y: Tensor,
    microbatches: int,
    schedule: str | Schedule,
    chunks: int,
    balance: list[int] | None,
    options: Options,
) -> Callable[[], None]:
    """One training step (gradients cleared after; no optimizer step). A builder for
    ``model`` is called under ``conveyor.empty_weights()``: each rank makes its own stages."""
    if not isinstance(model, nn.Module):
        with conveyor.empty_weights():
            model = model()
    pipe = conveyor.Pipeline(
        model,
        loss_fn=nn.functional.mse_loss,
        microbatches=microbatches,
        schedule=schedule,
        chunks=chunks,
        balance=balance,
        recompute=options.recompute,
        autocast=options.autocast,
    )

    def step() -> None:
        pipe.train_step(x, y)
        for p in pipe.parameters():
            p.grad = None
        TIMINGS.extend(pipe.last_step_timings())

    return step


def chosen_costs(chosen: Plan) -> list[tuple[float, float, float]]:
    """The per-stage (F, B, W) the planner predicted for its choice."""
    assert chosen.profile is not None
    return chosen.profile.costs(chosen.balance, chosen.built.split_backward)


def worker(args: argparse.Namespace) -> None:
    """Each of the 2 processes: plan, then measure."""
    torch.set_num_threads(1)
    conveyor.init()
    rank = dist.get_rank()
    dtype = torch.bfloat16 if args.autocast else None
    options = Options(nn.functional.mse_loss, 1, recompute=args.recompute, autocast=dtype)
    for label, build in (("benchmark", benchmark_model), ("unbalanced", unbalanced_model)):
        model, width_in, width_out = build()
        gen = torch.Generator().manual_seed(1)
        shape = (BATCH, width_in) if label == "benchmark" else (BATCH, TOKENS, width_in)
        x, y = torch.randn(*shape, generator=gen), torch.randn(BATCH, width_out, generator=gen)
        t0 = time.perf_counter()
        counts = [args.microbatches] if args.microbatches else None
        chosen = plan(
            model, x, y, nn.functional.mse_loss, PROCS, microbatch_counts=counts, options=options
        )
        took = time.perf_counter() - t0
        meta_plan, meta_took, pairs = None, 0.0, []
        if args.meta:
            with conveyor.empty_weights():
                meta_model = build()[0]
            t0 = time.perf_counter()
            meta_plan = plan(
                meta_model, x, y, nn.functional.mse_loss, PROCS, microbatch_counts=counts,
                options=options,
            )  # fmt: skip
            meta_took = time.perf_counter() - t0
            assert all(p.is_meta for p in meta_model.parameters())  # never made real
            # The profiles alone, alternating: the meta path against the real one, with
            # the machine's drift shared by both.
            m = meta_plan.microbatches
            pairs = [
                [sum(profile(net, x, y, nn.functional.mse_loss, m).times(False))
                 for net in (model, meta_model)]
                for _ in range(args.rounds)
            ]  # fmt: skip
        runs = {
            "planned": pipeline_step(
                model, x, y, chosen.microbatches, chosen.built, chosen.chunks, chosen.balance,
                options,
            )
        }
        cal = chosen.calibration
        if cal is not None:  # the calibration's own run again: how reproducible a step is
            runs["reference"] = pipeline_step(
                model, x, y, cal.microbatches, cal.schedule, cal.chunks, list(cal.balance),
                options,
            )
        if meta_plan is not None:
            runs["meta-planned"] = pipeline_step(
                lambda build=build: build()[0], x, y, meta_plan.microbatches, meta_plan.built,
                meta_plan.chunks, meta_plan.balance, options,
            )  # fmt: skip
        if label == "unbalanced":
            runs["parameter-balanced"] = pipeline_step(
                model, x, y, chosen.microbatches, chosen.built, chosen.chunks, None, options
            )
        measured: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                TIMINGS.clear()
                measured[key].append(median_step(runs[key], args.steps, args.warmup))
                if key == "planned":
                    planned_timings = list(TIMINGS)
        # Replay the planned run with the action times it really took: tells a wrong cost
        # (profile) from a wrong model of the step (overheads, waits).
        parts: list[list[Timing]] = [[] for _ in range(PROCS)]
        dist.all_gather_object(parts, planned_timings)
        real = measured_costs([t for part in parts for t in part], chosen.built.stages)
        replay = simulate(chosen.built, real).makespan
        if rank != 0:
            continue
        got = statistics.median(measured["planned"])
        print(
            f"\n## {label}: planned in {took:.1f} s: {chosen.schedule} chunks={chosen.chunks} "
            f"microbatches={chosen.microbatches} balance={chosen.balance}"
        )
        if cal is not None:
            print(
                f"calibrated on {cal.schedule} balance={list(cal.balance)}: measured "
                f"{cal.measured * 1e3:.2f} ms; scale F,B,W {[round(v, 2) for v in cal.scale]}, "
                f"latency {cal.latency * 1e3:.3f} ms, overhead {cal.overhead * 1e3:.2f} ms"
            )
        print(
            f"predicted {chosen.predicted_step * 1e3:.2f} ms, measured {got * 1e3:.2f} ms, "
            f"measured/predicted {got / chosen.predicted_step:.3f} (rounds: "
            f"{', '.join(f'{t * 1e3:.2f}' for t in measured['planned'])} ms)"
        )
        print(
            f"replayed with measured action times: {replay * 1e3:.2f} ms; "
            f"stage costs predicted/measured (ms): "
            f"{[[round(c * 1e3, 2) for c in st] for st in chosen_costs(chosen)]} / "
            f"{[[round(c * 1e3, 2) for c in st] for st in real]}"
        )
        if "reference" in measured and cal is not None:
            print(
                f"calibration reference re-measured: "
                f"{statistics.median(measured['reference']) * 1e3:.2f} ms "
                f"(in calibration {cal.measured * 1e3:.2f} ms)"
            )
        if meta_plan is not None:
            on_meta = statistics.median(measured["meta-planned"])
            same = (meta_plan.schedule, meta_plan.chunks, meta_plan.balance) == (
                chosen.schedule, chosen.chunks, chosen.balance
            )
            print(
                f"planned on the meta model in {meta_took:.1f} s: {meta_plan.schedule} "
                f"chunks={meta_plan.chunks} microbatches={meta_plan.microbatches} "
                f"balance={meta_plan.balance} ({'the same' if same else 'another'} plan); "
                f"predicted {meta_plan.predicted_step * 1e3:.2f} ms, measured "
                f"{on_meta * 1e3:.2f} ms, measured/predicted "
                f"{on_meta / meta_plan.predicted_step:.3f}"
            )
            real_f, meta_f = (statistics.median(p[i] for p in pairs) for i in (0, 1))
            print(
                f"profiled F + B of one micro-batch through the model, median of "
                f"{len(pairs)} alternating: real {real_f * 1e3:.2f} ms, meta "
                f"{meta_f * 1e3:.2f} ms (meta/real {meta_f / real_f:.3f})"
            )
        if "parameter-balanced" in measured:
            other = statistics.median(measured["parameter-balanced"])
            print(
                f"parameter-balanced split, same schedule: {other * 1e3:.2f} ms "
                f"(time-balanced is {other / got:.2f}x faster)"
            )
        print("\n" + "\n".join(chosen.table().splitlines()[:8]))


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, launch this script in 2 processes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        help="plan for this micro-batch count, as Pipeline(schedule='auto') does; 0: let "
        "the planner choose it too",
    )
    p.add_argument("--recompute", action="store_true", help="plan and run with recompute")
    p.add_argument("--autocast", action="store_true", help="plan and run under bf16 autocast")
    p.add_argument(
        "--meta",
        action="store_true",
        help="also plan the model built on the meta device, and measure that plan",
    )
    p.add_argument(
        "--counted",
        action="store_true",
        help="the counted estimate on the measured machine beside the real step instead",
    )
    args = p.parse_args(argv)
    if args.counted:
        return counted(args)
    return run_on_processes(__file__, PROCS, argv, worker, args)


def counted(args: argparse.Namespace) -> int:
    """``--counted``: every layout estimated and measured, one table."""
    import counted_accuracy as accuracy
    from common import on_processes

    from conveyor.planning import Hardware

    torch.set_num_threads(1)
    hw = Hardware.measure()
    estimates = accuracy.predict(hw, list(accuracy.LAYOUTS))
    balances = {name: est.balance for name, est in estimates.items()}
    results = on_processes(
        PROCS, accuracy.measure, None, balances, args.rounds, args.steps, args.warmup
    )
    slow = accuracy.slowdown(hw, results)
    print(f"{hw.name}: multiplies up to {hw.matmul_tflops * 1e3:.0f} GFLOP/s, memory "
          f"{hw.hbm_gbps:.1f} GB/s, link {hw.latency_s * 1e6:.0f} us + {hw.intra_node_gbps:.2f} "
          f"GB/s, {hw.action_overhead * 1e6:.0f} us per action; the ranks ran {slow:.2f}x "
          f"slower than that side by side\n")  # fmt: skip
    print(accuracy.table(estimates, results, slow))
    print("\nPer stage, one micro-batch, predicted / measured:\n")
    print(accuracy.stage_table(estimates, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
