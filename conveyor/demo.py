"""``conveyor demo``: the seeds' quick-start network, pipelined, on real handwritten digits.

The network of the OneFlow pipelining tutorial (``Flatten, Linear, ReLU, Linear, ReLU,
Linear``; 8x8 inputs instead of 28x28) is cut into 2 stages of 3 layers, one per process,
and trained with 4 micro-batches per step on the digits scikit-learn ships (1797 images).
Rank 0 shows the loss as it trains, then the held-out accuracy, the median step time and
the measured pipeline bubble beside the simulated one.

Run it with ``conveyor demo`` (or ``python -m conveyor.demo``): outside ``torchrun`` it
launches itself in ``--nproc`` processes through :mod:`conveyor.launch`, one compute
thread each; under ``torchrun`` it just runs. Exit code 0 when the held-out accuracy
is at least 90%, 1 otherwise.

With ``--checkpoint DIR`` it saves every ``--save-every`` steps and, started again (or
restarted by ``--max-restarts``), resumes from the last checkpoint: the batches are a
function of the step number, so the resumed run sees exactly the batches the lost one
would have.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conveyor.context import in_torchrun
from conveyor.trace import Timing, measured_costs

T = TypeVar("T")

MIN_ACCURACY = 0.9
# Schedules whose every rank holds 2 stages (interleaved or V placement).
TWO_CHUNK_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev")


def build_model() -> nn.Sequential:
    """The quick-start network of the seeds, for 8x8 digit images."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def load_data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Digits scaled to [0, 1]: (train x, train y, held-out x, held-out y), 75/25 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images / 16.0,
        digits.target,
        test_size=0.25,
        random_state=seed,
        stratify=digits.target,
    )
    return (
        torch.tensor(x_train, dtype=torch.float32),
        torch.tensor(y_train, dtype=torch.long),
        torch.tensor(x_test, dtype=torch.float32),
        torch.tensor(y_test, dtype=torch.long),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options."""
    p = argparse.ArgumentParser(prog="conveyor demo", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="stages per process (default: 2 for interleaved and V schedules, else 1)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nproc", type=int, default=2, help="processes to launch outside torchrun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="save to DIR every --save-every steps; resume from it when it holds one",
    )
    p.add_argument("--save-every", type=int, default=50, metavar="K", help="steps between saves")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when launching itself: restart all processes up to N times when one dies "
        "(resuming from --checkpoint)",
    )
    args = p.parse_args(argv)
    if args.save_every < 1:
        p.error("--save-every must be >= 1")
    return args


def epoch_order(n: int, epoch: int, seed: int) -> Tensor:
    """The shuffle of epoch ``epoch``: a function of (seed, epoch) alone, the same on every
    rank and in a resumed run."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def _gather(value: T) -> list[T]:
    """Every rank's ``value``, on every rank (just ``[value]`` in a world of one)."""
    if not dist.is_initialized():
        return [value]
    out: list[T] = [value] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def train(args: argparse.Namespace) -> int:
    """Train and evaluate on this rank; return the exit code."""
    import conveyor
    from conveyor.checkpoint import exists
    from conveyor.progress import Progress
    from conveyor.simulate import simulate

    ctx = conveyor.init()
    chunks = args.chunks or (2 if args.schedule in TWO_CHUNK_SCHEDULES else 1)
    stages = ctx.pp_size * chunks
    torch.manual_seed(args.seed)  # the same weights on every rank
    pipe = conveyor.Pipeline(
        build_model(),
        loss_fn=nn.functional.cross_entropy,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=chunks,
        balance=[3, 3] if stages == 2 else None,
        context=ctx,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    x_train, y_train, x_test, y_test = load_data(args.seed)

    per_epoch = len(x_train) // args.batch_size  # full batches only
    total = args.epochs * per_epoch
    start = 0
    if args.checkpoint is not None and exists(args.checkpoint):
        start = min(conveyor.load(pipe, args.checkpoint, opt) or 0, total)
        if ctx.rank == 0:
            print(f"resumed from {args.checkpoint} at step {start} of {total}", flush=True)
    measure_from = max(start, total - 10)  # bubble and action costs: median of the last steps
    step_times: list[float] = []
    bubbles: list[float] = []
    timings: list[Timing] = []
    progress = Progress(pipe, total - start, every=per_epoch)  # a log line per epoch
    progress.count = start
    order = epoch_order(len(x_train), start // per_epoch, args.seed)
    for step in range(start, total):
        # Every rank computes the same batch from the step number alone.
        if step % per_epoch == 0:
            order = epoch_order(len(x_train), step // per_epoch, args.seed)
        i = step % per_epoch
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        t0 = time.perf_counter()
        loss = pipe.train_step(x_train[idx], y_train[idx])
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        progress.step(loss, len(idx))
        if step >= measure_from:
            timings += pipe.last_step_timings()
            bubbles.append(pipe.measured_bubble())
        done = step + 1
        if args.checkpoint is not None and (done % args.save_every == 0 or done == total):
            conveyor.save(pipe, args.checkpoint, opt, step=done)
    progress.close()

    out = pipe.predict(x_test)
    accuracy = None
    if out is not None:
        accuracy = (out.argmax(dim=1) == y_test).float().mean().item()
    accuracy = next(a for a in _gather(accuracy) if a is not None)

    # Replay the schedule in simulated time with each stage's measured action costs.
    everyone = [t for part in _gather(timings) for t in part]
    costs = measured_costs(everyone, pipe.schedule.stages)
    if ctx.rank == 0:
        print(f"held-out accuracy: {accuracy:.1%} ({round(accuracy * len(y_test))}/{len(y_test)})")
    if ctx.rank == 0 and step_times:  # none when resumed from a finished run
        simulated = simulate(pipe.schedule, cost=costs, comm=0.0)
        warm = step_times[3:] or step_times
        print(
            f"median step: {statistics.median(warm) * 1e3:.2f} ms "
            f"({args.schedule}, {stages} stage(s) on {ctx.pp_size} process(es), "
            f"{args.microbatches} micro-batches of {args.batch_size // args.microbatches})"
        )
        print(
            f"bubble: measured {statistics.median(bubbles):.3f}, simulated "
            f"{simulated.bubble:.3f} from the measured costs per stage, "
            + ("F/B/W" if pipe.schedule.split_backward else "F/B")
            + " ms: "
            + ", ".join(
                "/".join(f"{c * 1e3:.2f}" for c in cost[: 3 if pipe.schedule.split_backward else 2])
                for cost in costs
            )
        )
    if ctx.rank == 0 and accuracy < MIN_ACCURACY:
        print(f"FAILED: held-out accuracy below {MIN_ACCURACY:.0%}; train longer (--epochs)")
    return 0 if accuracy >= MIN_ACCURACY else 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo; outside torchrun, launch it in ``--nproc`` processes first."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not in_torchrun() and args.nproc > 1:
        from conveyor.launch import main as launch

        restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
        return launch(
            ["--nproc-per-node", str(args.nproc), *restarts, "-m", "conveyor.demo", *argv]
        )
    code = train(args)
    # After train() has returned, so the pipeline's pending work is gone before its group.
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
