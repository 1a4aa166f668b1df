"""Every Python snippet in the README and the docs site (``docs/**/*.md``) runs: in one
process, and in several where the page says so (the Use snippet under ``conveyor launch
--nproc-per-node 2``, data x pipeline parallelism on 4 processes).

A snippet may use names its page introduced before it (``model``, ``pipe``, ``x``...);
``SETUP`` gives each snippet exactly those, keyed by how the snippet starts, and a new
snippet without an entry fails. A snippet that only runs somewhere else (the FSDP x tensor
parallel one needs 8 processes) has an empty entry and is named in ``ELSEWHERE``; one that
is slower than a few seconds is listed in ``SLOW``. Blocks marked ``text``, ``bash`` or
``json`` are not run. Identical snippets (the Use snippet is on two pages) run once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support import distributed

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

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

# How a snippet starts -> what its page defined before it ("" for a whole script).
SETUP: dict[str, str] = {
    "import torch, conveyor\nfrom torch import nn": "",
    "import torch, conveyor\nfrom transformers": "",
    "import torch, conveyor\nfrom transformers import LlamaConfig, LlamaForCausalLM\n\nctx = "
    "conveyor.init(pp=2, cp=2)": "",
    "import torch, lightning as L": "",
    "from conveyor.schedules import": "",
    "from transformers import LlamaConfig": "",
    "import torch, conveyor\nfrom conveyor.losses import TokenCrossEntropy": "",
    # The README's meta-device model, after its Use snippet (one process here).
    "from transformers import AutoModelForCausalLM": "import torch, conveyor\nconveyor.init()\n",
    "from conveyor.runtime.program import": "",
    # nanoGPT's model (examples/nanogpt.py), tiny, on a 2-rank pipeline in one process.
    "model = GPT(config)": f"""
import importlib.util, sys, torch, conveyor
spec = importlib.util.spec_from_file_location("nanogpt", "{ROOT / 'examples' / 'nanogpt.py'}")
nanogpt = importlib.util.module_from_spec(spec)
sys.modules["nanogpt"] = nanogpt
spec.loader.exec_module(nanogpt)
GPT = nanogpt.GPT
conveyor.init(pp=2)
config = nanogpt.GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32)
idx, targets = torch.randint(0, 32, (8, 16)), torch.randint(0, 32, (8, 16))
""",
    "# plan_me.py": "",
    "model.blocks[4].pipeline_stage = 1": """
import functools, torch, conveyor
from torch import nn
from tests.support.zoo import Net
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
    "conveyor.save(pipe, ": _MLP
    + """
pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=4, balance=[3, 3])
opt = torch.optim.AdamW(pipe.parameters())
pipe.train_step(x, y); opt.step()
step = 1
""",
    "plan = conveyor.plan(": _MLP,
    # The big-models guide's way back: a pipeline of the tiny Llama the page builds.
    'conveyor.save_pretrained(pipe, "llama-trained"': """
import torch, conveyor
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=100, use_cache=False)
with conveyor.empty_weights():
    model = AutoModelForCausalLM.from_config(config)
batch = {"input_ids": torch.randint(0, 100, (4, 8))}
batch["labels"] = batch["input_ids"]
pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=(batch, None),
                         context=conveyor.init(pp=2))
""",
    'pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=8, schedule="1f1b"': (
        _MLP + "conveyor.init(pp=2)\n"
    ),
    # Compiled stages (inductor, as the page says): a small layer list, 4 stages.
    'pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=8, schedule="zbv"': """
import torch, conveyor
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
loss_fn = nn.functional.mse_loss
inputs, targets = torch.randn(16, 16), torch.randn(16, 16)
conveyor.init(pp=2)
""",
}
# The FSDP x tensor-parallel snippet needs 8 processes: tests/parallel/test_sharding.py runs it in
# its 8-process world (``readme_snippet``), with a GPT of the example as ``model``.
ELSEWHERE = "from torch.distributed.tensor.parallel import"
SETUP[ELSEWHERE] = ""
# The Use snippet (README and quick start); test_readme.py reads it by this start.
USE = "import torch, conveyor\nfrom torch import nn\n\nctx = conveyor.init() "
# Snippets the pages run on several processes (how they start), and how many.
PROCESSES = {USE: 2, "ctx = conveyor.init(pp=2, dp=2)": 4}
# Snippets that take more than about 3 s in one process (importing transformers, export).
SLOW = {
    "import torch, conveyor\nfrom transformers",
    "import torch, lightning as L",
    "from transformers import AutoModelForCausalLM",
    'pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=8, schedule="zbv"',
}


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def snippets() -> list[str]:
    """Every Python snippet of the README, then of the docs pages, each once."""
    return list(dict.fromkeys(code for page in PAGES for code in _blocks(page)))


def _where(code: str) -> str:
    """The first page that shows ``code``, for test ids."""
    page = next(p for p in PAGES if code in _blocks(p))
    return str(page.relative_to(ROOT))


def _key(code: str) -> str:
    found = [k for k in SETUP if code.startswith(k)]
    assert found, f"snippet without a SETUP entry in {__file__} ({_where(code)}):\n{code}"
    return max(found, key=len)


def _slow(code: str) -> bool:
    # not _key: a snippet without an entry must fail its test, not the collection of every
    # module that imports this one
    return any(code.startswith(k) for k in SLOW)


def _processes(code: str) -> int | None:
    return next((n for start, n in PROCESSES.items() if code.startswith(start)), None)


def _run(rank: int, code: str, where: str) -> dict[str, Any]:
    """Execute ``code`` after its setup in a fresh namespace, in directory ``where``."""
    os.chdir(where)
    scope: dict[str, Any] = {}
    exec(compile(SETUP[_key(code)] + "\n" + code, "snippet.md", "exec"), scope)
    return {k: v for k, v in scope.items() if k in ("loss", "step")}


def readme_snippet(start: str) -> str:
    """The snippet (README first, then the docs) that begins with ``start``."""
    return next(c for c in snippets() if c.startswith(start))


def _param(code: str) -> Any:
    marks = [pytest.mark.slow] if _slow(code) else []
    name = f"{_where(code)}: {code.splitlines()[0][:40]}"
    return pytest.param(code, marks=marks, id=name)


@pytest.mark.parametrize(
    "code",
    # those that need several processes run below; the 8-process one in test_sharding.py
    [_param(c) for c in snippets() if _processes(c) is None and not c.startswith(ELSEWHERE)],
)
def test_snippet_runs_in_one_process(code: str, tmp_path: Path) -> None:
    # each snippet starts as a fresh script would: tests/conftest.py resets the context
    here = os.getcwd()
    try:
        _run(0, code, str(tmp_path))
    finally:
        os.chdir(here)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("code", [_param(c) for c in snippets() if _processes(c)])
def test_snippet_runs_where_the_page_says(code: str, tmp_path: Path) -> None:
    processes = _processes(code)
    if code.startswith(USE):
        # the Use snippet: plain init() under a 2-process launch is a 2-rank pipeline
        code = code.replace(
            "ctx = conveyor.init()", "ctx = conveyor.init()\nassert ctx.pp_size == 2", 1
        )
    results = distributed.run(_run, processes, code, str(tmp_path), timeout=180, fork=True)
    losses = {round(float(r["loss"]), 5) for r in results}
    assert len(losses) == 1  # the same loss on every rank


def test_every_snippet_has_a_setup() -> None:
    for code in snippets():
        _key(code)
