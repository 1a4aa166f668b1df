"""The ``conveyor`` command: ``simulate``, ``demo``, ``launch``, ``trace`` and ``plan``."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from conveyor.errors import ConfigError, ScheduleError

# Subcommands handled by another module's ``main(argv)``; their arguments are passed on
# untouched (argparse would otherwise try to read options meant for them).
FORWARDED = {
    "demo": ("conveyor.demo", "train the demo network with a pipeline (see README)"),
    "launch": ("conveyor.launch", "run a script in several processes (a front to torchrun)"),
    "trace": ("conveyor.trace", "draw a trace saved by pipe.save_trace: trace FILE --png PNG"),
    "plan": ("conveyor.plan_cli", "pick split, schedule and micro-batches for FILE.py's model"),
}


class _UsageError(Exception):
    """Bad command-line arguments; the message is one sentence."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message}; see '{self.prog} --help'")


def parse_cost(text: str) -> tuple[float, float, float]:
    """Parse ``F,B,W`` (three numbers >= 0) for ``--cost``."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(v >= 0 and v != float("inf") for v in values):
        raise ConfigError(f"--cost must be three numbers >= 0 as F,B,W (e.g. 1,2,1), got {text!r}")
    return (values[0], values[1], values[2])


def _build_parser() -> _Parser:
    parser = _Parser(prog="conveyor", description="Pipeline-parallel training for PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    # --- conveyor simulate ------------------------------------------------------------
    from conveyor.schedules.registry import SCHEDULE_NAMES

    simulate = commands.add_parser(
        "simulate",
        help="simulate a schedule: makespan, bubble, peak memory, timeline",
        description="Simulate a pipeline schedule with given per-action costs.",
    )
    simulate.add_argument(
        "--schedule", required=True, metavar="NAME", help=", ".join(SCHEDULE_NAMES)
    )
    simulate.add_argument("--ranks", required=True, type=int, metavar="P")
    simulate.add_argument("--microbatches", required=True, type=int, metavar="M")
    simulate.add_argument("--chunks", type=int, default=1, metavar="V", help="stages per rank")
    simulate.add_argument(
        "--cost",
        default="1,1,1",
        metavar="F,B,W",
        help="forward, backward (input), weight-gradient time of one rank's whole share "
        "for one micro-batch (default 1,1,1)",
    )
    simulate.add_argument("--comm", type=float, default=0.0, metavar="C", help="transfer time")
    simulate.add_argument("--json", action="store_true", help="print one JSON object")
    simulate.add_argument("--png", metavar="FILE", help="also draw the timeline to FILE")
    simulate.set_defaults(run=run_simulate)

    # --- forwarded subcommands (conveyor demo, conveyor launch) ---------------------------
    # main() hands their arguments on before argparse runs; these entries are for --help.
    for name, (_, summary) in FORWARDED.items():
        forwarded = commands.add_parser(name, help=summary, add_help=False)
        forwarded.add_argument("args", nargs=argparse.REMAINDER)

    # --- add further subcommands here -------------------------------------------------
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    """``conveyor simulate``: print the summary and timeline, or the JSON object."""
    from conveyor.schedules.registry import get_schedule
    from conveyor.simulate import ascii_timeline, simulate

    cost = parse_cost(args.cost)
    schedule = get_schedule(args.schedule, args.ranks, args.microbatches, args.chunks)
    result = simulate(schedule, cost=cost, comm=args.comm)
    if args.png:
        from conveyor.pictures import draw_timeline

        title = (
            f"{schedule.name}: {schedule.ranks} ranks x {schedule.chunks} chunks, "
            f"{schedule.microbatches} micro-batches, bubble {result.bubble:.1%}"
        )
        draw_timeline([(e.rank, *e.action, e.start, e.end) for e in result.events], args.png, title)
    if args.json:
        print(json.dumps(result.to_json_dict()))
        return 0
    data = result.to_json_dict()
    peaks = ", ".join(f"{p:g}" for p in result.peak_activations)
    print(
        f"schedule {schedule.name}: {schedule.ranks} ranks x {schedule.chunks} chunk(s), "
        f"{schedule.microbatches} micro-batches, cost F,B,W = {args.cost}, comm {args.comm:g}"
    )
    print(
        f"makespan {data['makespan']:g}  span {data['span']:g}  bubble {result.bubble:.2%}  "
        f"peak activations per rank {peaks}"
    )
    width = max(80, shutil.get_terminal_size((160, 24)).columns)
    print(ascii_timeline(result, width=width))
    if args.png:
        print(f"timeline picture: {args.png}")
    return 0


def _forward(name: str, argv: list[str]) -> int:
    module_name = FORWARDED[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(
            f"conveyor {name}: not available in this install ({module_name} is missing)",
            file=sys.stderr,
        )
        return 2
    code = module.main(argv)
    return int(code) if code is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``conveyor`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in FORWARDED:
        return _forward(args_list[0], args_list[1:])
    parser = _build_parser()
    try:
        args = parser.parse_args(args_list)
        code: int = args.run(args)
        return code
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except _UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except (ConfigError, ScheduleError) as error:
        print(f"conveyor: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
