"""conveyor demo: a small network trained with a 2-stage pipeline on handwritten digits.

The network is Flatten -> Linear(64, 512) -> ReLU -> Linear(512, 512) -> ReLU ->
Linear(512, 10) on the 8x8 digit images scikit-learn ships (1797 images, 75% to train).
It is cut into 2 stages of 3 layers, one per process, and trained with 4 micro-batches
per step. Rank 0 shows the loss as it trains, then the held-out accuracy, the median step
time and the measured pipeline bubble beside the simulated one.

Outside torchrun, ``conveyor demo`` launches itself in ``--nproc`` processes through
:mod:`conveyor.cli.launch` (one compute thread each); with ``--nproc 1`` the one process runs
both stages itself. Under torchrun it just runs.

Exit code 0 when the held-out accuracy reaches ``--min-accuracy``; 3 when it does not
(a result, not a crash: when the demo launches itself the launcher checks it, so
``--max-restarts`` restarts only crashed workers); ``--min-accuracy 0`` skips the check.
Under your own ``torchrun --max-restarts``, pass ``--min-accuracy 0``: torchrun restarts
after any non-zero exit.

The loop is :class:`conveyor.Trainer`'s: ``fit`` over the training images in full batches,
reshuffled each epoch by a permutation seeded with ``(--seed, epoch)``, a progress line per
epoch, then ``evaluate`` with the ``accuracy`` metric on the held-out images. With
``--checkpoint DIR`` it saves every ``--save-every`` steps and, started again (or restarted
by ``--max-restarts``), resumes from the last checkpoint (``fit(resume=True)``) exactly
where the lost run was: the same batches, the same losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conveyor.cli._args import HelpFormatter, Parser, plain
from conveyor.context import in_torchrun
from conveyor.observe.trace import measured_costs
from conveyor.runtime.timing import Timing
from conveyor.training import Callback, FitState, ProgressBar, Trainer

T = TypeVar("T")

LOW_ACCURACY = 3
"""The exit code when the held-out accuracy is below ``--min-accuracy``."""
# Options for the launching process only; the workers it starts do not get them.
LAUNCHER_ONLY = ("nproc", "max_restarts")


def build_model() -> nn.Sequential:
    """Flatten -> Linear(64, 512) -> ReLU -> Linear(512, 512) -> ReLU -> Linear(512, 10), for
    8x8 digit images."""
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


def _parser() -> Parser:
    p = Parser(
        prog="conveyor demo",
        description=plain(__doc__ or ""),
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # the workers get every option spelled out (worker_argv)
    )
    p.add_argument("--epochs", type=int, default=15, help="passes over the training images")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument(
        "--schedule", default="1f1b", metavar="NAME", help="a schedule (see conveyor simulate)"
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="stages per process (default: 2 for interleaved and V schedules, else 1)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="processes to launch outside torchrun (1: this process runs both stages)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, split and shuffle")
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.9,
        metavar="A",
        help=f"exit with code {LOW_ACCURACY} when the held-out accuracy (0 to 1) is below A; "
        "0 skips the check",
    )
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
    # Where the workers of a self-launched demo leave the accuracy for the launcher.
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options."""
    from conveyor.errors import ConfigError
    from conveyor.schedules.registry import check_chunks

    p = _parser()
    args = p.parse_args(argv)
    for flag in ("epochs", "microbatches", "batch_size", "nproc", "save_every", "chunks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.batch_size < args.microbatches:
        p.error(
            f"--batch-size {args.batch_size} is smaller than --microbatches "
            f"{args.microbatches}; each micro-batch needs an image"
        )
    if not 0 <= args.min_accuracy <= 1:
        p.error(f"--min-accuracy must be between 0 and 1, got {args.min_accuracy:g}")
    try:
        check_chunks(args.schedule, args.chunks, flags=True)
    except ConfigError as error:
        p.error(str(error))
    return args


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The options for the processes the demo launches, each spelled out in full (torchrun
    reads abbreviations such as ``--nproc`` as its own), without the launcher's own."""
    argv: list[str] = []
    for action in _parser()._actions:
        value = getattr(args, action.dest, None)
        if action.dest in LAUNCHER_ONLY or value is None or value == action.default:
            continue
        argv += [action.option_strings[-1], str(value)]
    return argv


class StepClock(Callback):
    """A callback that times every step and keeps the last ``last`` steps' action timings
    and measured bubbles (a collective: every rank runs it)."""

    def __init__(self, last: int = 10) -> None:
        self.last = last
        self.step_times: list[float] = []
        self.bubbles: list[float] = []
        self.timings: list[Timing] = []
        self._then = 0.0

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        self._then = time.perf_counter()

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._then)
        if state.step > max(state.start_step, state.max_steps - self.last):
            self.timings += state.pipe.last_step_timings()
            if state.pipe.context.distributed:
                self.bubbles.append(state.pipe.measured_bubble())
        self._then = time.perf_counter()


class SayResumed(Callback):
    """A callback that says, on rank 0, where a fit resumed from its checkpoint."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        if state.resumed and state.pipe.context.rank == 0:
            print(
                f"resumed from {self.folder} at step {state.start_step} of {state.max_steps}",
                flush=True,
            )


def _gather(value: T) -> list[T]:
    """Every rank's ``value``, on every rank (just ``[value]`` in a world of one)."""
    if not dist.is_initialized():
        return [value]
    out: list[T] = [value] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def train(args: argparse.Namespace) -> int:
    """Train and evaluate on this rank; return the exit code."""
    from torch.utils.data import TensorDataset

    import conveyor
    from conveyor.schedules.registry import default_chunks
    from conveyor.simulate import simulate

    # In one process (no torchrun) that process runs both stages of the 2-rank pipeline.
    ctx = conveyor.init(pp=None if in_torchrun() else 2)
    chunks = default_chunks(args.schedule) if args.chunks is None else args.chunks
    stages = ctx.pp_size * chunks
    torch.manual_seed(args.seed)  # the same weights on every rank, and the shuffle's seed
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

    clock = StepClock(last=10)  # step times; bubble and action costs of the last 10 steps
    callbacks: list[Callback] = [clock, ProgressBar(every=len(x_train) // args.batch_size)]
    if args.checkpoint is not None:
        callbacks.insert(0, SayResumed(args.checkpoint))
    trainer = Trainer(
        pipe,
        opt,
        callbacks=callbacks,
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.save_every if args.checkpoint is not None else None,
    )
    # Full batches of a fresh shuffle each epoch; with --checkpoint, continue from it.
    trainer.fit(
        TensorDataset(x_train, y_train),
        batch_size=args.batch_size,
        epochs=args.epochs,
        resume=args.checkpoint is not None,
    )
    held_out = TensorDataset(x_test, y_test)
    accuracy = trainer.evaluate(held_out, batch_size=len(x_test), metrics=["accuracy"])["accuracy"]

    # Replay the schedule in simulated time with each stage's measured action costs.
    everyone = [t for part in _gather(clock.timings) for t in part]
    costs = measured_costs(everyone, pipe.schedule.stages)
    if ctx.rank != 0:
        return 0
    print(f"held-out accuracy: {accuracy:.1%} ({round(accuracy * len(y_test))}/{len(y_test)})")
    if clock.step_times:  # none when resumed from a finished run
        simulated = simulate(pipe.schedule, cost=costs, comm=0.0)
        warm = clock.step_times[3:] or clock.step_times
        where = (
            f"{stages} stage(s) on {ctx.pp_size} process(es)"
            if ctx.distributed
            else f"{stages} stage(s) in one process ({ctx.pp_size} pipeline ranks simulated)"
        )
        print(
            f"median step: {statistics.median(warm) * 1e3:.2f} ms ({args.schedule}, {where}, "
            f"{args.microbatches} micro-batches of {args.batch_size // args.microbatches})"
        )
        kinds = 3 if pipe.schedule.split_backward else 2
        per_stage = ", ".join("/".join(f"{c * 1e3:.2f}" for c in cost[:kinds]) for cost in costs)
        measured = (
            f"measured {statistics.median(clock.bubbles):.3f}, "
            if clock.bubbles
            else "not measured (one process runs the stages one after another), "
        )
        print(
            f"bubble: {measured}simulated {simulated.bubble:.3f} from the measured costs per "
            f"stage, {'F/B/W'[: 2 * kinds - 1]} ms: {per_stage}"
        )
        if clock.bubbles:  # the simulation counts transfers as free; the runtime does not
            print(
                f"gap: a step simulated from those costs takes {simulated.makespan * 1e3:.2f} "
                f"ms; the rest is transfers (posting, waiting), the optimizer and bookkeeping"
            )
    if args.result_file is not None:  # the launching process checks the accuracy
        Path(args.result_file).write_text(json.dumps({"accuracy": accuracy}))
        return 0
    return check_accuracy(accuracy, args.min_accuracy)


def check_accuracy(accuracy: float, minimum: float) -> int:
    """0, or :data:`LOW_ACCURACY` after one line on stderr when ``accuracy`` < ``minimum``."""
    if accuracy >= minimum:
        return 0
    print(
        f"conveyor demo: held-out accuracy {accuracy:.1%} is below --min-accuracy "
        f"{minimum:g}; train longer (--epochs) or pass --min-accuracy 0 to skip the check",
        file=sys.stderr,
        flush=True,
    )
    return LOW_ACCURACY


def main(argv: list[str] | None = None) -> int:
    """Run the demo; outside torchrun with ``--nproc`` > 1, launch it in that many processes
    and check the accuracy they report here (so a low one is not restarted as a crash)."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if not in_torchrun() and args.nproc > 1:
        from conveyor.cli.launch import main as launch

        restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
        with tempfile.TemporaryDirectory(prefix="conveyor-demo-") as folder:
            result = Path(folder) / "result.json"
            workers = [*worker_argv(args), "--result-file", str(result)]
            code = launch(
                [
                    "--nproc-per-node",
                    str(args.nproc),
                    *restarts,
                    "-m",
                    "conveyor.cli.demo",
                    *workers,
                ]
            )
            if code != 0:
                return code  # a crash; the launcher has said which rank and why
            if not result.is_file():
                print("conveyor demo: the workers reported no accuracy", file=sys.stderr)
                return 1
            accuracy = float(json.loads(result.read_text())["accuracy"])
        return check_accuracy(accuracy, args.min_accuracy)
    code = train(args)
    # After train() has returned, so the pipeline's pending work is gone before its group.
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
