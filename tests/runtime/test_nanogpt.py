"""nanoGPT's model as nanoGPT's script uses it (``examples/nanogpt.py``): ``forward(idx,
targets)`` returns ``(logits, loss)``, ``loss_fn=None`` takes the tuple's one 0-dim tensor,
and the optimizer built by ``configure_optimizers`` before the ``Pipeline`` trains exactly
what the unsplit model's would, on every schedule and with data parallelism."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import conveyor
from tests.support import distributed
from tests.support.helpers import assert_close, merge_tied, reset_context, tied_names

ROOT = Path(__file__).resolve().parents[2]
ROWS, LENGTH, STEPS, LR = 8, 16, 2, 1e-2
SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev", "zb-auto"]


def nanogpt() -> ModuleType:
    """``examples/nanogpt.py`` as a module (examples are scripts, not a package)."""
    if "nanogpt" in sys.modules:
        return sys.modules["nanogpt"]
    spec = importlib.util.spec_from_file_location("nanogpt", ROOT / "examples" / "nanogpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def model_and_data(layers: int = 4) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    ng = nanogpt()
    torch.manual_seed(0)
    model = ng.GPT(ng.GPTConfig(block_size=LENGTH, vocab_size=32, n_layer=layers, n_head=2,
                                n_embd=32))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 32, (STEPS, ROWS, LENGTH + 1), generator=gen)
    return model, [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def unsplit() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The unsplit model trained as nanoGPT trains it: its losses, gradients per step and
    parameters after the steps."""
    model, data = model_and_data()
    opt = model.configure_optimizers(0.1, LR, (0.9, 0.95))
    losses, grads = [], []
    for x, y in data:
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined(schedule: str, dp_rank: int = 0, dp: int = 1, ctx: Any = None) -> dict[str, Any]:
    """The same training through a pipeline, the optimizer built first (nanoGPT's order)."""
    model, data = model_and_data()
    opt = model.configure_optimizers(0.1, LR, (0.9, 0.95))
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=4, schedule=schedule, context=ctx)
    losses, grads = [], []
    share = ROWS // dp
    for x, y in data:
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        losses.append(float(pipe.train_step((x[rows], y[rows]))))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def check(results: list[dict[str, Any]], what: str) -> None:
    losses, grads, params = unsplit()
    alias = tied_names(model_and_data()[0])
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-5), what
    for step in range(STEPS):
        got = merge_tied([r["grads"][step] for r in results], alias, what)
        assert_close(got, {n: grads[step][n] for n in got}, f"{what} step {step}")
        assert set(got) == {alias[n] for n in grads[step]}, what
    got = merge_tied([r["params"] for r in results], alias, what)
    assert_close(got, {n: params[n] for n in got}, f"{what}: parameters after AdamW")


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_nanogpt_as_it_is_in_one_process(schedule: str) -> None:
    reset_context()
    check([pipelined(schedule, ctx=conveyor.init(pp=2))], schedule)


def _on_ranks(rank: int, schedules: list[str], dp: int) -> list[dict[str, Any]]:
    ctx = conveyor.init(dp=dp)
    return [pipelined(s, ctx.dp_rank, dp, ctx) for s in schedules]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_nanogpt_on_every_schedule_in_two_processes() -> None:
    results = distributed.run(_on_ranks, 2, SCHEDULES, 1, fork=True)
    for k, schedule in enumerate(SCHEDULES):
        check([results[r][k] for r in range(2)], schedule)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_nanogpt_with_data_parallelism() -> None:
    results = distributed.run(_on_ranks, 4, ["1f1b"], 2, fork=True)
    # replicas hold the same parameters: each pipeline's two ranks make the whole model
    for replica in (results[:2], results[2:]):
        check([r[0] for r in replica], "pp 2 x dp 2")


class _Tuple(torch.nn.Module):
    """A last layer returning a tuple: its output and ``scalars`` 0-dim tensors."""

    def __init__(self, scalars: int) -> None:
        super().__init__()
        self.scalars = scalars

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        return (x, *(x.sum() * k for k in range(1, self.scalars + 1)), None)


@pytest.mark.parametrize(
    ("scalars", "message"),
    [
        (0, r"but \(Tensor\[2, 4\], None\) holds no such tensors; pass Pipeline\(loss_fn="
         r"lambda out, _: out\[1\]\)"),
        (2, r"but \(Tensor\[2, 4\], Tensor\[\], Tensor\[\], None\) holds 2 such tensors; "
         r"pass Pipeline\(loss_fn=lambda out, _: out\[2\]\)"),
    ],
)  # fmt: skip
def test_a_tuple_without_one_loss_is_refused_naming_its_shapes(scalars: int, message: str) -> None:
    reset_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), _Tuple(scalars))
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    with pytest.raises(conveyor.ConfigError, match="a tuple output's loss is its one 0-dim "
                       "tensor, " + message):  # fmt: skip
        pipe.train_step(torch.randn(4, 4))


def test_a_tuple_with_one_loss_gives_it() -> None:
    reset_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), _Tuple(1))
    x = torch.randn(4, 4)
    want = model(x)[1]  # a sum, taken for a mean over rows: each half weighs 2 of 4 rows
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    assert float(pipe.train_step(x)) == pytest.approx(float(want.detach()) / 2, rel=1e-6)
