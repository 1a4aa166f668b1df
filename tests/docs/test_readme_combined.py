"""The README's two examples combined, as a new user combines them (issue 55): the
big-model example (a transformers Llama built under ``conveyor.empty_weights()``, captured
by torch.export on its first batch) with the optimizer built as the Use example builds it,
``torch.optim.AdamW(pipe.parameters())`` right after the ``Pipeline``, before the first
step, and the Use example's ``opt.step(); opt.zero_grad()`` after each step. On 2
processes its loss falls at every step, exactly as with the optimizer built after the
first step, and the optimizer holds every parameter each rank trains."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from tests.docs.test_readme_snippets import USE, readme_snippet
from tests.support import distributed

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

BIG = "from transformers import AutoModelForCausalLM"
STEPS = 3


def combined(after_first_step: bool) -> str:
    """The big-model snippet with the Use snippet's optimizer (built right after the
    Pipeline, or after the first step) and its step, for :data:`STEPS` steps."""
    use = readme_snippet(USE).splitlines()
    build = next(line for line in use if line.startswith("opt = "))
    step = next(line.strip() for line in use if "opt.step()" in line)
    seed = next(line for line in use if line.startswith("torch.manual_seed("))
    out = ["import torch, conveyor", "conveyor.init()", seed, "losses = []"]
    for line in readme_snippet(BIG).splitlines():
        if line.startswith("loss = pipe.train_step("):
            out += [f"for i in range({STEPS}):", f"    {line}", "    losses.append(float(loss))"]
            if after_first_step:
                out += ["    if i == 0:", f"        {build}"]
            out.append(f"    {step}")
            continue
        out.append(line)
        if line.startswith("pipe = conveyor.Pipeline(") and not after_first_step:
            out.append(build)
    code = "\n".join(out)
    assert code.count(build) == 1 and step in code, code
    return code


def _run(rank: int, where: str) -> dict[str, Any]:
    os.chdir(where)
    out: dict[str, Any] = {}
    for after in (False, True):
        scope: dict[str, Any] = {}
        exec(compile(combined(after), "README.md", "exec"), scope)
        held = {id(p) for g in scope["opt"].param_groups for p in g["params"]}
        trained = list(scope["pipe"].parameters())
        out[after] = {
            "losses": scope["losses"],
            "held": len(trained) > 0 and all(id(p) in held for p in trained),
        }
    return out


def test_the_big_model_example_trains_with_the_use_examples_optimizer(tmp_path: Path) -> None:
    results = distributed.run(_run, 2, str(tmp_path), timeout=300, fork=True)
    for rank, got in enumerate(results):
        before, after = got[False], got[True]
        assert before["held"] and after["held"], rank
        losses = before["losses"]
        assert all(b < a for a, b in itertools.pairwise(losses)), (rank, losses)  # trains
        assert losses == after["losses"], rank  # as with the optimizer built after
        assert losses == results[0][False]["losses"], rank
