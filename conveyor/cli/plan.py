"""``conveyor plan FILE.py [--ranks P] [--memory-limit BYTES]``, or for a cluster
``conveyor plan --model CONFIG --hardware NAME --gpus N --seq S --global-batch B
[--memory-limit GB]`` (:mod:`conveyor.cli.cluster`).

FILE.py defines ``build()`` returning ``(model, inputs, targets, loss_fn)``: the model as
``Pipeline`` takes it, one sample batch and the loss. The command profiles the model in
this one process (the link between ranks gets the defaults of :mod:`conveyor.planning.profiler`)
and prints the chosen configuration and the ranked alternatives.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError, ConveyorError, one_line

BUILD = "define build() returning (model, inputs, targets, loss_fn)"
"""What a FILE.py must do, as the errors say it."""


def _load(path: str) -> tuple[Any, Any, Any, Any]:
    """Run FILE.py's ``build()``; a :class:`ConfigError` in one sentence for a bad file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no file {path}; pass a Python file that defines build()")
    module_spec = importlib.util.spec_from_file_location("conveyor_plan_target", file)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot load {path} as Python; pass a .py file that defines build()")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ConfigError(
            f"{path} line {error.lineno}: {error.msg}; it must be Python that defines build()"
        ) from None
    except Exception as error:
        raise ConfigError(
            f"running {path} raised {one_line(error)}; run 'python {path}' to see where"
        ) from None
    build = getattr(module, "build", None)
    if not callable(build):
        raise ConfigError(f"{path} has no build(); {BUILD}")
    try:
        built = build()
    except ConveyorError:
        raise
    except Exception as error:
        raise ConfigError(
            f"{path}: build() raised {one_line(error)}; call it in Python to see where"
        ) from None
    if not isinstance(built, tuple) or len(built) != 4:
        raise ConfigError(f"{path}: build() returned {type(built).__name__}; {BUILD}")
    return built[0], built[1], built[2], built[3]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``conveyor plan``: the planner on FILE.py's model; print its choice and table.

    Args:
        argv: The arguments after ``conveyor plan`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 on bad input (the file, a flag, a memory limit
        nothing fits), 1 when profiling the model fails.

    Raises:
        SystemExit: For ``--help`` (code 0) and for a usage error (code 2, printed in
            one line).
    """
    from conveyor.cli import cluster
    from conveyor.cli._args import subcommand
    from conveyor.planning.planner import plan

    parser = subcommand("conveyor plan", __doc__)
    parser.add_argument(
        "file",
        nargs="?",
        help="a Python file whose build() returns (model, inputs, targets, loss_fn)",
    )
    parser.add_argument("--ranks", type=int, default=2, metavar="P", help="pipeline ranks")
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="BYTES",
        help="FILE.py: most bytes per rank for parameters, their gradients and the "
        "activations the schedule holds (not optimizer state; default: no limit); --model: "
        "most GB per GPU, everything counted (default: the GPU's memory)",
    )
    cluster.add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if (args.file is None) == (args.model is None):
        parser.error("give FILE.py (plan on this machine) or --model CONFIG (plan a cluster)")
    if args.model is not None:
        if args.memory_limit is not None and not args.memory_limit > 0:
            parser.error(f"--memory-limit must be a number of GB > 0, got {args.memory_limit:g}")
        try:
            return cluster.run(args, parser)
        except ConveyorError as e:
            print(f"conveyor plan: error: {e}", file=sys.stderr)
            return 2
    if args.ranks < 1:
        parser.error(f"--ranks must be an integer >= 1, got {args.ranks}")
    if args.memory_limit is not None and not args.memory_limit > 0:
        parser.error(f"--memory-limit must be a number of bytes > 0, got {args.memory_limit:g}")
    try:
        model, inputs, targets, loss_fn = _load(args.file)
        chosen = plan(model, inputs, targets, loss_fn, args.ranks, args.memory_limit)
    except ConveyorError as e:
        # The planner names its Python argument; here it is the flag.
        message = str(e).replace("memory_limit=", "--memory-limit ")
        print(f"conveyor plan: error: {message}", file=sys.stderr)
        # Bad input (the file, the flags) exits 2 as in every conveyor command; a failure
        # while profiling the model (PipelineError) exits 1.
        return 2 if isinstance(e, ConfigError) else 1
    peaks = ", ".join(f"{b / 2**20:.1f}" for b in chosen.peak_memory)
    extra = " vocab_parallel=True" if chosen.vocab_parallel else ""
    extra += " recompute=True" if chosen.recompute else ""
    print(
        f"schedule={chosen.schedule} chunks={chosen.chunks} microbatches={chosen.microbatches} "
        f"balance={chosen.balance}{extra} predicted step {chosen.predicted_step * 1e3:.2f} ms, "
        f"peak memory per rank (MB) {peaks}\n{chosen.basis}"
    )
    zero_bubble = chosen.zero_bubble_line()
    print(f"{zero_bubble}\n" if zero_bubble else "")
    print(chosen.table())
    return 0
