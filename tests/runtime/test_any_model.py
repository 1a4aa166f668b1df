"""Any model through the real runtime: skips, annotations (both styles), execution
sequences and a tied-weight GPT equal the unsplit model on 1, 2 and 4 processes, under
several schedules, after optimizer steps; shapes may change every step. Without zero_grad,
every .grad (the tied weight's copies included) accumulates the unsplit model's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support.helpers import (
    Trace,
    assert_close,
    grads_of,
    lm_loss,
    merge_tied,
    mse,
    sgd_trace,
    tied_names,
)
from tests.support.trainer_forked import run_forked
from tests.support.zoo import Deep, Net, Skip, TinyGPT, net_sequence

Batch = tuple[Any, torch.Tensor]
LR = 0.05  # SGD's, in every trace


def _annotate(blocks: nn.ModuleList, stages: int, style: str) -> None:
    for s in range(1, stages):
        block = blocks[s * len(blocks) // stages]
        if style == "attribute":
            block.pipeline_stage = s  # type: ignore[assignment]
        else:
            conveyor.set_stage(block, s)


class WideSkip(Skip):
    """Skip with 8 blocks: h0 feeds the last block, so it crosses every boundary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.blocks[0](x))
        h = h0
        for block in self.blocks[1:-1]:
            h = torch.tanh(block(h))
        return self.blocks[-1](h + h0)


def build(kind: str, stages: int) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """A fresh model of ``kind`` split into ``stages`` (same weights every call)."""
    if kind == "skip":
        return WideSkip(), mse
    if kind in ("attribute", "set_stage"):
        model = Deep(blocks=8)
        _annotate(model.blocks, stages, kind)
        return model, mse
    if kind == "sequence":
        net = Net()
        net.bn1.eval()  # batch statistics per micro-batch would differ from the whole batch
        return net_sequence(net), mse
    if kind == "gpt":
        gpt = TinyGPT(layers=8)
        _annotate(gpt.blocks, stages, "attribute")
        return gpt, lm_loss
    raise ValueError(kind)


def batches(kind: str, sizes: list[tuple[int, int]]) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out: list[Batch] = []
    for n, t in sizes:
        if kind == "gpt":
            idx = torch.randint(0, 11, (n, t + 1), generator=g)
            out.append((idx[:, :-1], idx[:, 1:]))
        elif kind == "sequence":
            out.append((torch.randn(n, 1, 6, 6, generator=g), torch.randn(n, 3, generator=g)))
        elif kind == "skip":
            out.append((torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)))
        else:
            out.append((torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)))
    return out


def reference(kind: str, stages: int, data: list[Batch]) -> Trace:
    model, loss_fn = build(kind, stages)

    def step(x: Any, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    return sgd_trace(model.named_parameters(), step, data, LR)


# (model, schedule, chunks, micro-batches, (batch, sequence length) of each step)
CONFIGS = [
    (kind, sched, chunks, 3, [(6, 5), (7, 3), (5, 4)])
    for kind in ("skip", "attribute", "set_stage", "sequence", "gpt")
    for sched, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
] + [
    # every other split-backward / V schedule on the skip and the tied-weight models
    (kind, sched, chunks, m, [(8, 5), (9, 2)])
    for kind in ("skip", "gpt")
    for sched, chunks, m in (
        ("zbv", 2, 4),
        ("dualpipev", 2, 7),
        ("zb-h2", 1, 4),
        ("zb-late", 1, 4),
        ("zb-auto", 1, 4),
        ("looped-bfs", 2, 3),
    )
]


Results = dict[tuple[str, str, int], Trace]


def _runs(kind: str, pp: int, chunks: int) -> bool:
    """The execution sequence has 5 steps with parameters: at 8 stages some rank would
    train nothing, which Pipeline refuses at construction (tests/runtime/test_pipeline_api.py)."""
    return not (kind == "sequence" and pp * chunks > 5)


ACCUMULATE = [(4, 5), (5, 3)]  # two steps without zero_grad, the sequence length changing


def _accumulate(ctx: conveyor.Context, pp: int) -> dict[str, torch.Tensor]:
    """Two train_steps of the tied-weight GPT without zero_grad: this rank's .grad."""
    model, loss_fn = build("gpt", pp)
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=2, context=ctx)
    for x, y in batches("gpt", ACCUMULATE):
        pipe.train_step(x, y)
    return grads_of(pipe.named_parameters())


def _run(rank: int, pp: int) -> tuple[Results, dict[str, torch.Tensor]]:
    ctx = conveyor.init(pp=pp)
    out = {}
    for kind, sched, chunks, m, sizes in CONFIGS:
        if not _runs(kind, pp, chunks):
            continue
        model, loss_fn = build(kind, pp * chunks)
        pipe = conveyor.Pipeline(
            model, loss_fn=loss_fn, microbatches=m, schedule=sched, chunks=chunks, context=ctx
        )
        out[(kind, sched, chunks)] = sgd_trace(
            pipe.named_parameters(), pipe.train_step, batches(kind, sizes), LR
        )
    return out, _accumulate(ctx, pp)


def _check(results: list[Results], pp: int) -> None:
    for kind, sched, chunks, _, sizes in CONFIGS:
        if not _runs(kind, pp, chunks):
            continue
        want = reference(kind, pp * chunks, batches(kind, sizes))
        got = [r[(kind, sched, chunks)] for r in results]
        alias = tied_names(build(kind, pp * chunks)[0])
        for i, (loss, grads, params) in enumerate(want):
            what = f"{kind} {sched} pp={pp} step {i}"
            for rank_trace in got:
                assert rank_trace[i][0] == pytest.approx(loss, rel=1e-5), what
            got_grads = merge_tied([t[i][1] for t in got], alias, what)
            assert_close(got_grads, grads, what + " grads")
            got_params = merge_tied([t[i][2] for t in got], alias, what)
            assert_close(got_params, params, what + " params")


def _check_accumulated(parts: list[dict[str, torch.Tensor]], pp: int) -> None:
    """Every .grad after two steps equals the unsplit model's gradients of both steps."""
    model, loss_fn = build("gpt", pp)
    for x, y in batches("gpt", ACCUMULATE):
        loss_fn(model(x), y).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    what = f"gradients accumulated over 2 steps, pp={pp} on {len(parts)} processes"
    assert_close(merge_tied(parts, tied_names(build("gpt", pp)[0]), what), want, what)


@pytest.fixture(scope="module")
def two_processes() -> list[tuple[Results, dict[str, torch.Tensor]]]:
    return run_forked(_run, 2, 2)


# In the slow lane (over 2 s each): one process runs pp=2 as it runs pp=4, and the
# two-process run (slow) is pp=2.
@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_one_process_world(pp: int) -> None:
    configs, accumulated = _run(0, pp)
    _check([configs], pp)
    _check_accumulated([accumulated], pp)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes(two_processes: list[tuple[Results, dict[str, torch.Tensor]]]) -> None:
    _check([configs for configs, _ in two_processes], 2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_four_processes() -> None:
    results = run_forked(_run, 4, 4)
    _check([configs for configs, _ in results], 4)
    parts = [accumulated for _, accumulated in results]
    assert "tok_emb.weight" in parts[0] and "lm_head.weight" in parts[3]  # tied over 0 and 3
    _check_accumulated(parts, 4)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tied_gradients_accumulate_over_steps_without_zero_grad(
    two_processes: list[tuple[Results, dict[str, torch.Tensor]]],
) -> None:
    # Each step sums the tied weight's gradient over its copies (embedding on rank 0, head
    # on rank 1). The sum must take that step's gradient alone: summing the accumulated
    # .grad counts the earlier step's gradient again on every copy.
    parts = [accumulated for _, accumulated in two_processes]
    assert "tok_emb.weight" in parts[0] and "lm_head.weight" in parts[1]
    _check_accumulated(parts, 2)
