"""``conveyor plan FILE.py [--ranks P] [--memory-limit BYTES]``.

FILE.py defines ``build()`` returning ``(model, inputs, targets, loss_fn)``: the model as
``Pipeline`` takes it, one sample batch and the loss. The command profiles the model in
this one process (the link between ranks gets the defaults of :mod:`conveyor.profile`)
and prints the chosen configuration and the ranked alternatives.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.errors import ConveyorError


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("conveyor_plan_target", Path(path))
    if spec is None or spec.loader is None:
        raise ConveyorError(f"cannot load {path}; pass a Python file that defines build()")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "build", None)):
        raise ConveyorError(
            f"{path} has no build(); define build() returning (model, inputs, targets, loss_fn)"
        )
    return module.build


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner on FILE.py's model; 0 on success, 1 on a user error."""
    from conveyor.plan import plan

    p = argparse.ArgumentParser(prog="conveyor plan", description=__doc__.splitlines()[0])
    p.add_argument(
        "file", help="a Python file whose build() returns (model, inputs, targets, loss_fn)"
    )
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument("--memory-limit", type=float, default=None, help="bytes per rank")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        model, inputs, targets, loss_fn = _load(args.file)()
        chosen = plan(model, inputs, targets, loss_fn, args.ranks, args.memory_limit)
    except ConveyorError as e:
        print(f"conveyor plan: {e}", file=sys.stderr)
        return 1
    peaks = ", ".join(f"{b / 2**20:.1f}" for b in chosen.peak_memory)
    print(
        f"schedule={chosen.schedule} chunks={chosen.chunks} microbatches={chosen.microbatches} "
        f"balance={chosen.balance} predicted step {chosen.predicted_step * 1e3:.2f} ms, "
        f"peak memory per rank (MB) {peaks}\n"
    )
    print(chosen.table())
    return 0
