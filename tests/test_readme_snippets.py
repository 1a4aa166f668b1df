"""Every Python snippet in the README runs: in one process, and in several where the README
says so (the Use snippet under ``conveyor launch --nproc-per-node 2``, data x pipeline
parallelism on 4 processes).

A snippet may use names the README introduced before it (``model``, ``pipe``, ``x``...);
``SETUP`` gives each snippet exactly those, and a new snippet without an entry fails.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests import distributed

ROOT = Path(__file__).resolve().parents[1]

_MLP = """
import torch, conveyor
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(),
                      nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
loss_fn = nn.functional.cross_entropy
x, y = torch.randn(32, 8, 8), torch.randint(0, 10, (32,))
loader = [(x, y)] * 2
"""

# The first line of each snippet -> what the README defined before it.
SETUP: dict[str, str] = {
    "import torch, conveyor\nfrom torch import nn": "",
    "import torch, conveyor\nfrom transformers": "",
    "model.blocks[4].pipeline_stage = 1": """
import functools, torch, conveyor
from torch import nn
from tests.zoo import Net
class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x
model, resnet = Blocks(), Net()
""",
    "ctx = conveyor.init(pp=2, dp=2)": _MLP,
    "conveyor.save(pipe, ": _MLP + """
pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=4, balance=[3, 3])
opt = torch.optim.AdamW(pipe.parameters())
pipe.train_step(x, y); opt.step()
step = 1
""",
    "plan = conveyor.plan(": _MLP,
    "pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=8, schedule=\"1f1b\"": (
        _MLP + "conveyor.init(pp=2)\n"
    ),
}
# The FSDP x tensor-parallel snippet needs 8 processes: tests/test_sharding.py runs it in
# its 8-process world (``readme_snippet``), with a GPT of the example as ``model``.
ELSEWHERE = "from torch.distributed.tensor.parallel import"
SETUP[ELSEWHERE] = ""
# Snippets the README runs on several processes, and how many.
PROCESSES = {
    "import torch, conveyor\nfrom torch import nn": 2,
    "ctx = conveyor.init(pp=2, dp=2)": 4,
}


def snippets() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _key(code: str) -> str:
    found = [k for k in SETUP if code.startswith(k)]
    assert found, f"README snippet without a SETUP entry in {__file__}:\n{code}"
    return max(found, key=len)


def _run(rank: int, code: str, where: str) -> dict[str, Any]:
    """Execute ``code`` after its setup in a fresh namespace, in directory ``where``."""
    os.chdir(where)
    scope: dict[str, Any] = {}
    exec(compile(SETUP[_key(code)] + "\n" + code, "README.md", "exec"), scope)
    return {k: v for k, v in scope.items() if k in ("loss", "step")}


def readme_snippet(start: str) -> str:
    """The README snippet that begins with ``start``."""
    return next(c for c in snippets() if c.startswith(start))


@pytest.mark.parametrize(
    "code",
    # data parallelism needs its 4 processes; the 8-process one runs in test_sharding.py
    [c for c in snippets() if "dp=2" not in c and not c.startswith(ELSEWHERE)],
    ids=lambda c: c.splitlines()[0][:40],
)
def test_snippet_runs_in_one_process(code: str, tmp_path: Path) -> None:
    import conveyor.context as context

    context._current = None  # each snippet starts as a fresh script would
    here = os.getcwd()
    try:
        _run(0, code, str(tmp_path))
    finally:
        os.chdir(here)


@pytest.mark.parametrize(
    "code",
    [c for c in snippets() if _key(c) in PROCESSES],
    ids=lambda c: c.splitlines()[0][:40],
)
def test_snippet_runs_where_the_readme_says(code: str, tmp_path: Path) -> None:
    if "dp=2" not in code:
        # the Use snippet: plain init() under a 2-process launch is a 2-rank pipeline
        code = code.replace(
            "ctx = conveyor.init()", "ctx = conveyor.init()\nassert ctx.pp_size == 2"
        )
    results = distributed.run(_run, PROCESSES[_key(code)], code, str(tmp_path), timeout=180)
    losses = {round(float(r["loss"]), 5) for r in results}
    assert len(losses) == 1  # the same loss on every rank
