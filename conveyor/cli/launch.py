"""``conveyor launch`` / ``python -m conveyor.launch``: a thin front to ``torchrun``.

Every argument goes to ``torch.distributed.run`` unchanged, so anything torchrun accepts
works here::

    python -m conveyor.launch --nproc-per-node 2 train.py --lr 0.1
    python -m conveyor.launch --nnodes 2 --node-rank 0 --master-addr host0 \\
        --nproc-per-node 4 train.py

Two differences in the environment, each only when the variable is not already set:

- ``OMP_NUM_THREADS=1``, so on CPU each process computes with one thread and the processes
  do not fight over the cores (torchrun itself only does that, with a warning, for more
  than one process per node). Set it yourself to give each process more threads.
- glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (1 GiB): freed
  gradient and activation buffers stay in the heap for the next step instead of going back
  to the OS, which otherwise makes every step fault in fresh pages (measured: 8 fused weight
  gradients of 4 x Linear(1024) cost 12.3 ms with ``.grad`` set to None each step, 8.6 ms
  with these set, 7.0 ms with ``.grad`` kept). Memory then stays at its peak, as with
  PyTorch's caching allocators.

When a worker fails, torchrun prints each failed rank's traceback and its report; then
the launcher prints, last, at most 5 lines naming the rank that failed first and its error
in one line. For that each worker runs its script through :mod:`conveyor.cli.worker`,
which records an escaping exception (type, message, time) in the error file torchrun
gives the worker; the script sees the same ``sys.argv``, ``sys.path`` and ``__main__`` as
under torchrun alone.

Surviving a lost process: ``--max-restarts N`` is torchrun's elastic restart. When a worker
dies, torchrun stops the others (conveyor's bounded waits, ``conveyor.init(timeout=...)``,
make sure none hangs meanwhile) and starts them all again, up to N times; a script that
saves with :func:`conveyor.save` and resumes with :func:`conveyor.load` then loses at most
the steps since its last checkpoint::

    conveyor launch --nproc-per-node 2 --max-restarts 3 train.py --checkpoint ckpt

torchrun restarts after any non-zero exit, a deliberate one too (a script that checks its
result and exits 1): check such results in the launching process, as ``conveyor demo``
does, or exit 0 under ``--max-restarts``.

For that, with ``--max-restarts`` above 0 the launcher also sets, unless set,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: in torch 2.13 the restarted workers otherwise
reuse the first attempt's rendezvous store and their process group connects to the dead
workers' stale addresses (pytorch/pytorch#135712); and on one machine it uses the c10d
rendezvous on a free port (``--standalone``) instead of the static one, whose store also
outlives the attempt. On several machines restarts need ``--rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-id JOB``: the static rendezvous with ``--max-restarts``
is refused there (after a restart a node cannot connect and the others hang). A
rendezvous that fails, such as a c10d one whose peer never arrives within
``--rdzv-conf join_timeout=SECONDS`` (torchrun's default: 600), ends with a short summary
instead of torchrun's bare traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

from conveyor.errors import one_line

# glibc reads these at process start, so the launcher sets them for its workers.
MALLOC_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's environment variables the launcher sets to 1 GiB for its workers, unless set."""

HELP = """\
conveyor launch runs torchrun (every option below is torchrun's) and adds:

  - OMP_NUM_THREADS=1 unless set: one compute thread per process, so the processes of
    one machine do not fight over its CPU cores.
  - MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ (glibc) at 1 GiB unless set: freed
    buffers stay in the heap for the next step instead of being faulted in again.
  - --max-restarts N on one machine uses the c10d rendezvous on a free port
    (--standalone) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so restarted workers do not
    reuse the dead ones' store (pytorch/pytorch#135712). torchrun restarts after any
    non-zero exit, also a script's deliberate one.
    On several machines --max-restarts needs the c10d rendezvous (example below): with
    the static one (--master-addr, --node-rank) restarted workers cannot reconnect, so
    that combination is refused.
  - When a worker fails, the last lines (at most 5) name the rank that failed first and
    its error in one line; the tracebacks stay above them. A rendezvous that fails (a
    node that never arrives within --rdzv-conf join_timeout=SECONDS) ends in one line too.

examples:
  conveyor launch --nproc-per-node 2 train.py --lr 0.1
  conveyor launch --nproc-per-node 2 --max-restarts 3 train.py --checkpoint ckpt

  two machines, 4 processes each (run it on both; HOST is the first one's address):
  conveyor launch --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29400 --rdzv-id job1 --max-restarts 3 train.py
"""
"""``conveyor launch --help``'s description, above torchrun's options."""

SUMMARY_WIDTH = 100
"""Columns of the failure summary's lines (wrapped at word boundaries)."""


def _parser() -> argparse.ArgumentParser:
    """torchrun's parser, named ``conveyor launch``, with one-line usage errors."""
    from torch.distributed.run import get_args_parser

    from conveyor.cli._args import one_line_errors

    parser = get_args_parser()
    parser.prog = "conveyor launch"
    parser.usage = "conveyor launch [OPTIONS] (SCRIPT | -m MODULE) [ARGS ...]"
    parser.description = HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return one_line_errors(parser)


def _wrap_workers(config: argparse.Namespace) -> None:
    """Run each worker's script through :mod:`conveyor.cli.worker`, which records a
    failing worker's error for :func:`failure_summary`."""
    if config.no_python or config.run_path or not getattr(config, "use_env", True):
        return  # not a Python script run by torchrun's interpreter: leave it as it is
    target = ["-m"] if config.module else []
    config.training_script_args = [*target, config.training_script, *config.training_script_args]
    config.training_script = "conveyor.cli.worker"
    config.module = True


def _recorded(failure: Any) -> dict[str, Any] | None:
    """What the worker wrote to its error file, if anything."""
    message = failure.message
    return message if isinstance(message, dict) else None


def _stopped(failure: Any) -> bool:
    """Whether torchrun stopped this worker (SIGTERM, nothing recorded) after another failed."""
    return failure.exitcode == -signal.SIGTERM and _recorded(failure) is None


def _order(failures: Mapping[int, Any]) -> list[int]:
    """Failed ranks, the first failure first.

    A worker that raised recorded the time to the microsecond; otherwise only torchrun's
    whole second at which it noticed is known, and workers torchrun stopped itself come
    last whatever their time.
    """

    def key(rank: int) -> tuple[bool, float, int]:
        failure = failures[rank]
        precise = (_recorded(failure) or {}).get("extraInfo", {}).get("time")
        when = float(precise) if isinstance(precise, (int, float)) else float(failure.timestamp)
        return (_stopped(failure), when, rank)

    return sorted(failures, key=key)


def _exit(failure: Any) -> str:
    """How a worker ended: ``exit N`` or ``killed by SIGNAL``."""
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return f"exit {failure.exitcode}"


def _wrap(text: str, max_lines: int) -> list[str]:
    """``text`` wrapped for the summary, cut with " ..." after ``max_lines`` lines."""
    return textwrap.wrap(
        text,
        SUMMARY_WIDTH,
        subsequent_indent="  ",
        max_lines=max_lines,
        placeholder=" ...",
        break_on_hyphens=False,
    )


def failure_summary(failures: Mapping[int, Any]) -> str:
    """A summary of failed workers, at most 5 lines.

    Args:
        failures: Global rank -> torchrun's ``ProcessFailure`` record, for every worker
            that failed (at least one).

    Returns:
        The rank that failed first with its exit and its error in one line (wrapped at
        word boundaries to at most 3 lines, "..." where cut), the other ranks that
        failed, and those torchrun stopped.
    """
    order = _order(failures)
    rank, first = order[0], failures[order[0]]
    recorded = _recorded(first)
    message = " ".join(str(recorded.get("message", "")).split()) if recorded else ""
    if message:
        text = f"rank {rank} failed first ({_exit(first)}): {message}"
    elif first.exitcode < 0:
        text = f"rank {rank} failed first: {_exit(first)}"
    else:
        text = f"rank {rank} failed first ({_exit(first)}) without an exception; see its output"
    lines = _wrap(f"conveyor launch: {text}", 3)
    failed = [f"rank {r} ({_exit(failures[r])})" for r in order[1:] if not _stopped(failures[r])]
    stopped = [str(r) for r in order[1:] if _stopped(failures[r])]
    if failed:
        lines += _wrap(f"conveyor launch: also failed: {', '.join(failed)}", 1)
    if stopped:
        what = "rank" if len(stopped) == 1 else "ranks"
        lines += _wrap(f"conveyor launch: torchrun then stopped {what} {', '.join(stopped)}", 1)
    return "\n".join(lines)


def _max_nodes(nnodes: str) -> int:
    """The largest node count of ``--nnodes N`` or ``MIN:MAX`` (0 if unreadable: torchrun
    then reports it)."""
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return 0


def _check_restarts(config: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse ``--max-restarts`` with the static rendezvous across machines: after a
    restart its workers connect to the first attempt's store and hang."""
    static = config.rdzv_backend == "static" and not config.standalone
    if config.max_restarts > 0 and static and _max_nodes(config.nnodes) > 1:
        parser.error(
            f"--max-restarts {config.max_restarts} with --nnodes {config.nnodes} needs the "
            f"c10d rendezvous (the static one, --master-addr/--node-rank, cannot reconnect "
            f"restarted workers across machines): give every node --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT --rdzv-id JOB instead"
        )


def rendezvous_summary(error: BaseException, config: argparse.Namespace) -> str:
    """A summary of a rendezvous that failed, at most 4 lines.

    torchrun raises such errors without a word when a node never arrives.

    Args:
        error: The rendezvous error torchrun raised.
        config: torchrun's parsed arguments.

    Returns:
        Which rendezvous failed and why, and what every node must agree on.
    """
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    backend = config.rdzv_backend
    if backend == "static":
        address = f"{config.master_addr}:{config.master_port or 29500}"
    else:
        address = config.rdzv_endpoint or "localhost:29400"
    if isinstance(error, RendezvousTimeoutError):
        join_timeout = _parse_rendezvous_config(config.rdzv_conf).get("join_timeout", "600")
        what = f"did not gather --nnodes {config.nnodes} nodes within join_timeout={join_timeout} s"
    else:
        what = f"failed: {one_line(error).rstrip('.')}"
    same = "--rdzv-endpoint and --rdzv-id"
    if backend == "static":
        same = "--master-addr and --master-port"
    text = (
        f"conveyor launch: the {backend} rendezvous at {address} {what}; start conveyor "
        f"launch on every node with the same --nnodes, {same}, and check that {address} is "
        f"reachable from each"
    )
    return "\n".join(_wrap(text, 4))


def exit_code(failures: Mapping[int, Any]) -> int:
    """The launcher's exit code after workers failed.

    Args:
        failures: Global rank -> torchrun's ``ProcessFailure`` record.

    Returns:
        The exit code of the worker that failed first, else of another; 1 if none has
        one (workers killed by a signal).
    """
    codes = [failures[rank].exitcode for rank in _order(failures)]
    return next((code for code in codes if code > 0), 1)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``, each Python worker through :mod:`conveyor.cli.worker`.

    When workers fail, torchrun's report is followed by a short summary
    (:func:`failure_summary`); a failed rendezvous ends with one too
    (:func:`rendezvous_summary`).

    Args:
        argv: torchrun's arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every worker succeeded; else the exit code of the worker that failed
        first (1 if it has none), or 1 for a failed rendezvous.

    Raises:
        SystemExit: For ``--help`` (code 0) and for a usage error (code 2, printed in
            one line).
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    args = sys.argv[1:] if argv is None else list(argv)
    # Only launched workers get these. A one-process run (python train.py) keeps torch's
    # thread per core, as a PyTorch user expects of a lone process and what an idle
    # machine wants; the README says what to set on a shared one. Setting it in
    # conveyor.init instead would come too late for the malloc tunables (read at start)
    # and would silently slow a single process on a machine of its own.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in MALLOC_TUNABLES:
        os.environ.setdefault(name, str(1 << 30))
    parser = _parser()
    config = parser.parse_args(args)
    _check_restarts(config, parser)
    if config.max_restarts > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if config.rdzv_backend == "static" and str(config.nnodes) in ("1", "1:1"):
            config.standalone = True
    script = config.training_script
    _wrap_workers(config)
    try:
        run(config)  # type: ignore[no-untyped-call]
    except ChildFailedError as e:
        e.name = script  # torchrun's report would name conveyor.cli.worker
        print(e.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        print(failure_summary(e.failures), file=sys.stderr, flush=True)
        return exit_code(e.failures)
    except (RendezvousError, DistError) as e:  # the agent's own rendezvous, before any worker
        print(rendezvous_summary(e, config), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
