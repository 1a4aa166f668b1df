"""The step's walk: from ``Pipeline.train_step`` down to the engine and back, each
conveyor module is entered once on the way down (no call comes back up into a module
above it), in every mode, with data parallelism's and FSDP's hooks off and on."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import conveyor
from tests.support.helpers import mse
from tests.support.models import mlp

PACKAGE = "conveyor"


def _module(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None


def revisits(call: Callable[[], Any]) -> list[tuple[str, ...]]:
    """Every conveyor call stack seen during ``call()`` (outermost first, each module once
    per run of frames) in which some module comes back after another module below it."""
    found: set[tuple[str, ...]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or _module(frame) is None:
            return
        chain: list[str] = []
        f: FrameType | None = frame
        while f is not None:
            name = _module(f)
            if name is not None and (not chain or chain[-1] != name):
                chain.append(name)
            f = f.f_back
        chain.reverse()
        if len(set(chain)) != len(chain):
            found.add(tuple(chain))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return sorted(found)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_each_module_is_entered_once_on_the_way_down(schedule: str) -> None:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule=schedule,
                             chunks=2 if schedule == "zbv" else None)  # fmt: skip
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe.train_step(x, y)  # the first step learns shapes; the walk is any later one's
    assert revisits(lambda: pipe.train_step(x, y)) == []
    assert revisits(lambda: pipe.eval_step(x, y)) == []
    assert revisits(lambda: pipe.predict(x)) == []
