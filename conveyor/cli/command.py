"""The ``conveyor`` command: ``simulate``, ``demo``, ``launch``, ``trace`` and ``plan``."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence

from conveyor.cli._args import HelpFormatter, Parser
from conveyor.errors import ConfigError, ScheduleError

# Subcommands handled by another module's ``main(argv)``; their arguments are passed on
# untouched (argparse would otherwise try to read options meant for them).
FORWARDED = {
    "demo": ("conveyor.cli.demo", "train a small network on handwritten digits in 2 stages"),
    "launch": ("conveyor.cli.launch", "run a script in several processes (a front to torchrun)"),
    "trace": ("conveyor.cli.trace", "draw a trace saved by pipe.save_trace: trace FILE --png PNG"),
    "plan": ("conveyor.cli.plan", "pick split, schedule and micro-batches for FILE.py's model"),
    "convert": ("conveyor.cli.convert", "a conveyor checkpoint into transformers' format, or back"),
}
"""Subcommand name -> (module whose ``main(argv)`` runs it, one-line help)."""


def parse_cost(text: str) -> tuple[float, float, float]:
    """Parse ``--cost``'s ``F,B,W``.

    Args:
        text: Three comma-separated numbers, e.g. ``1,2,1``.

    Returns:
        The three numbers as floats.

    Raises:
        ConfigError: Unless they are three finite numbers >= 0.
    """
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(v >= 0 and v != float("inf") for v in values):
        raise ConfigError(f"--cost must be three numbers >= 0 as F,B,W (e.g. 1,2,1), got {text!r}")
    return (values[0], values[1], values[2])


def _numbers(text: str, counts: tuple[int, ...], option: str, form: str) -> tuple[float, ...]:
    """``text``'s comma-separated numbers, as many as one of ``counts``, each finite and
    >= 0; else a ConfigError saying ``option`` takes one number or ``form``."""
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in counts or not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"{option} must be one number >= 0, or {form}, got {text!r}")
    return values


def parse_a2a(text: str) -> tuple[float, float]:
    """Parse ``--a2a``'s ``X`` (the same for F and B) or ``F,B``.

    Args:
        text: One number or two comma-separated ones, e.g. ``1`` or ``1,2``.

    Returns:
        The pair (F, B) as floats.

    Raises:
        ConfigError: Unless one or two finite numbers >= 0.
    """
    values = _numbers(text, (1, 2), "--a2a", "two as F,B (e.g. 1,2)")
    return (values[0], values[-1])


def parse_vocab(text: str) -> tuple[float, float, float, float]:
    """Parse ``--vocab``'s ``X`` (the same for every pass) or ``E,S,T,G``.

    Args:
        text: One number or four comma-separated ones, e.g. ``0.5`` or ``0.1,1,2,0.1``.

    Returns:
        The durations (E, S, T, G) as floats.

    Raises:
        ConfigError: Unless one or four finite numbers >= 0.
    """
    values = _numbers(text, (1, 4), "--vocab", "four as E,S,T,G (e.g. 0.1,1,2,0.1)")
    e, s, t, g = values * 4 if len(values) == 1 else values
    return (e, s, t, g)


def _build_parser() -> Parser:
    """The ``conveyor`` parser: ``simulate`` and, for ``--help``, the forwarded commands."""
    from conveyor import __version__

    parser = Parser(
        prog="conveyor",
        description="Pipeline-parallel training for PyTorch.",
        epilog="'conveyor COMMAND --help' tells more about each command.",
    )
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    # --- conveyor simulate ------------------------------------------------------------
    from conveyor.schedules.registry import SCHEDULE_NAMES, default_chunks

    simulate = commands.add_parser(
        "simulate",
        help="simulate a schedule: makespan, bubble, peak memory, timeline",
        description="Simulate a pipeline schedule with given per-action costs, in cost units "
        "(any unit: the costs set it).",
        formatter_class=HelpFormatter,
    )
    simulate.add_argument(
        "--schedule", required=True, metavar="NAME", help="one of " + ", ".join(SCHEDULE_NAMES)
    )
    simulate.add_argument("--ranks", required=True, type=int, metavar="P", help="pipeline ranks")
    simulate.add_argument(
        "--microbatches", required=True, type=int, metavar="M", help="micro-batches per step"
    )
    twos = [name for name in SCHEDULE_NAMES if default_chunks(name) == 2]
    simulate.add_argument(
        "--chunks",
        type=int,
        default=None,
        metavar="V",
        help=f"stages per rank (default: 2 for {', '.join(twos)}; else 1)",
    )
    simulate.add_argument(
        "--cost",
        default="1,1,1",
        metavar="F,B,W",
        help="forward, backward (input gradient) and weight-gradient cost of one rank's "
        "whole share of the model for one micro-batch",
    )
    simulate.add_argument(
        "--comm", type=float, default=0.0, metavar="C", help="cost of one transfer between ranks"
    )
    simulate.add_argument(
        "--a2a",
        default="0",
        metavar="X|F,B",
        help="MoE expert all-to-all time of one rank's whole share for one micro-batch, one "
        "for F and B or F,B: an action alone waits for its own; in an overlapped F+B pair "
        "each hides behind the other's compute",
    )
    simulate.add_argument(
        "--no-overlap",
        action="store_true",
        help="run the schedule's F+B pairs as separate actions (to compare, with --a2a)",
    )
    simulate.add_argument(
        "--vocab",
        default=None,
        metavar="X|E,S,T,G",
        help="vocabulary parallelism: place the passes E (embedding), S (output forward, "
        "loss), T (output backward) and G (embedding gradient) of every micro-batch, each "
        "a barrier of every rank, with these durations on one rank's share of the "
        "vocabulary layers (one for all four, or E,S,T,G)",
    )
    simulate.add_argument("--json", action="store_true", help="print one JSON object instead")
    simulate.add_argument("--png", metavar="FILE", help="also draw the timeline to FILE")
    simulate.set_defaults(run=run_simulate)

    # --- forwarded subcommands (conveyor demo, launch, trace, plan) ------------------------
    # main() hands their arguments on before argparse runs; these entries are for --help.
    for name, (_, summary) in FORWARDED.items():
        forwarded = commands.add_parser(name, help=summary, add_help=False)
        forwarded.add_argument("args", nargs=argparse.REMAINDER)

    # --- add further subcommands here -------------------------------------------------
    return parser


def _check_simulate_args(args: argparse.Namespace) -> int:
    """The chunk count to simulate; a one-sentence ConfigError naming the flag that is wrong."""
    from conveyor.schedules.registry import check_chunks

    for flag in ("ranks", "microbatches", "chunks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be an integer >= 1, got {value}")
    if not (math.isfinite(args.comm) and args.comm >= 0):
        raise ConfigError(f"--comm must be a finite number >= 0, got {args.comm:g}")
    return check_chunks(args.schedule, args.chunks, flags=True)


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``conveyor simulate``: print the summary and timeline, or the JSON object.

    Args:
        args: The parsed ``conveyor simulate`` arguments.

    Returns:
        The exit code, 0.

    Raises:
        ConfigError: For a bad flag value, schedule name or chunk count; or when
            ``--png`` cannot be drawn.
    """
    from conveyor.schedules import unpaired
    from conveyor.schedules.registry import get_schedule
    from conveyor.schedules.vocab import with_vocab
    from conveyor.simulate import ascii_timeline, simulate

    cost = parse_cost(args.cost)
    a2a = parse_a2a(args.a2a)
    vocab = None if args.vocab is None else parse_vocab(args.vocab)
    chunks = _check_simulate_args(args)
    schedule = get_schedule(args.schedule, args.ranks, args.microbatches, chunks)
    if args.no_overlap:
        schedule = unpaired(schedule)
    if vocab is not None:
        schedule = with_vocab(schedule, cost)  # drops the pairs: passes run alone
    result = simulate(schedule, cost=cost, comm=args.comm, a2a=a2a, vocab=vocab)
    moe = ""
    if any(a2a):
        pairs = "no-overlap" if args.no_overlap else f"{result.overlapped} F+B pairs overlapped"
        moe = f", a2a F,B = {a2a[0]:g},{a2a[1]:g} ({pairs})"
    if vocab is not None:
        moe += f", vocab E,S,T,G = {','.join(f'{v:g}' for v in vocab)}"
    if args.png:
        from conveyor.observe.pictures import draw_timeline
        from conveyor.runtime.timing import Timing

        title = (
            f"{schedule.name}: {schedule.ranks} ranks x {schedule.chunks} chunk(s), "
            f"{schedule.microbatches} micro-batches, cost F,B,W = {args.cost}{moe}"
            f"{chr(10) if vocab is not None else ', '}bubble {result.bubble:.1%}"
        )
        passes = [Timing(e.rank, e.action.kind, -1, e.action.microbatch, e.start, e.end)
                  for e in result.vocab_events]  # fmt: skip
        draw_timeline(
            [Timing(e.rank, *e.action, e.start, e.end) for e in result.events] + passes,
            args.png,
            title,
            unit="cost units",
        )
    if args.json:
        print(json.dumps(result.to_json_dict()))
        return 0
    data = result.to_json_dict()
    peaks = ", ".join(f"{p:g}" for p in result.peak_activations)
    print(
        f"schedule {schedule.name}: {schedule.ranks} ranks x {schedule.chunks} chunk(s), "
        f"{schedule.microbatches} micro-batches, cost F,B,W = {args.cost}, comm {args.comm:g}"
        f"{moe}"
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
    """Run forwarded subcommand ``name`` with ``argv``; its exit code."""
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
    """Run the ``conveyor`` command.

    Args:
        argv: The arguments after ``conveyor`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 for a usage or configuration error (printed in
        one line), 1 when standard output closes early, or a forwarded subcommand's own
        code.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in FORWARDED:
        try:
            return _forward(args_list[0], args_list[1:])
        except SystemExit as exit_:  # --help, a usage error (already printed)
            return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    parser = _build_parser()
    try:
        args = parser.parse_args(args_list)
        code: int = args.run(args)
        return code
    except SystemExit as exit_:  # --help, --version, a usage error (already printed)
        return exit_.code if isinstance(exit_.code, int) else 0
    except (ConfigError, ScheduleError) as error:
        print(f"conveyor {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into head: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
