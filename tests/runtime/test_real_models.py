"""Models as people bring them (transformers GPT-2, Llama, BERT, T5, BART; torchvision /
timm style ResNet, MobileNet, EfficientNet, ViT) split with no changes and trained exactly:
gradients equal to the unsplit model's (within what rounding reaches, rounding_bound in
tests/support/helpers.py; loss to 1e-6) in one process at pp=2 and pp=4 and on 2
processes, under 1f1b, interleaved-1f1b, zb-h1 and zbv; the second step changes the
sequence length (or batch).

Batch norm normalises each micro-batch by its own statistics, so for the vision models
with batch norm the reference is the unsplit model accumulating gradients over the same
micro-batches (as gradient accumulation would); for the others it is the whole batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import conveyor
from conveyor.runtime import microbatch
from tests.support.helpers import assert_close, grads_of, merge_tied, tied_names
from tests.support.real_models import MODELS, has_batch_norm, shared
from tests.support.trainer_forked import run_forked

pytest.importorskip("transformers")

SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)]
MICROBATCHES = 4
# Capturing these takes over 3 s (once per process, in real_models.shared).
SLOW = {"t5", "bart", "bert"}  # about 2 s each: the fast lane stays under 90 s
Result = list[tuple[float, dict[str, torch.Tensor]]]


def _loss(model: Any, inputs: Any, targets: Any, loss_fn: Any) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.loss if loss_fn is None else loss_fn(out, targets)


def reference(name: str) -> Result:
    """(loss, gradients) of each step of the unsplit model."""
    model, batches, loss_fn = shared(name)
    accumulate = has_batch_norm(model)
    out: Result = []
    for inputs, targets in batches():
        model.zero_grad(set_to_none=True)
        if accumulate:
            n = microbatch.batch_size(inputs, "inputs")
            parts = microbatch.divide(inputs, MICROBATCHES, "inputs")
            goals = microbatch.divide(targets, MICROBATCHES, "targets")
            total = torch.zeros(())
            for x, y in zip(parts, goals, strict=True):
                loss = _loss(model, x, y, loss_fn) * (microbatch.batch_size(x, "x") / n)
                loss.backward()
                total += loss.detach()
        else:
            total = _loss(model, inputs, targets, loss_fn)
            total.backward()
        out.append((float(total.detach()), grads_of(model.named_parameters())))
    return out


def pipelined(
    name: str, schedule: str, chunks: int, ctx: conveyor.Context, steps: int = 2
) -> Result:
    model, batches, loss_fn = shared(name)
    pipe = conveyor.Pipeline(
        model,
        loss_fn=loss_fn,
        microbatches=MICROBATCHES,
        schedule=schedule,
        chunks=chunks,
        context=ctx,
    )
    out: Result = []
    for inputs, targets in batches()[:steps]:
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.train_step(inputs, targets)
        out.append((float(loss), grads_of(pipe.named_parameters())))
    return out


def check(name: str, got: list[Result], want: Result, what: str) -> None:
    alias = tied_names(shared(name)[0])
    for step, (loss, grads) in enumerate(want):
        for rank_result in got:
            assert rank_result[step][0] == pytest.approx(loss, rel=1e-6), f"{what} step {step} loss"
        # a tied weight's copies on several ranks: the same gradient
        merged = merge_tied([rank_result[step][1] for rank_result in got], alias, what)
        assert set(merged) == {alias[n] for n in grads}, f"{what} step {step}: names"
        got_grads = {n: merged[alias[n]] for n in grads}
        assert_close(got_grads, grads, f"{what} step {step}")


def _all_schedules(
    rank: int, pp: int, names: list[str], steps: int = 2
) -> dict[tuple[str, str], Result]:
    ctx = conveyor.init(pp=pp)
    return {
        (name, schedule): pipelined(name, schedule, chunks, ctx, steps)
        for name in names
        for schedule, chunks in SCHEDULES
    }


# pp=2 in the slow lane: the same code as pp=4 in one process, and the two-process run
# (slow) is pp=2.
@pytest.mark.parametrize("pp", [pytest.param(2, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MODELS]
)
def test_one_process(name: str, pp: int) -> None:
    want = reference(name)
    got = _all_schedules(0, pp, [name])
    for schedule, _ in SCHEDULES:
        check(name, [got[(name, schedule)]], want, f"{name} {schedule} pp={pp}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes() -> None:
    names = list(MODELS)
    # One step each: the changing sequence length is covered in one process above.
    results = run_forked(_all_schedules, 2, 2, names, 1, timeout=600)
    for name in names:
        want = reference(name)[:1]
        for schedule, _ in SCHEDULES:
            got = [r[(name, schedule)] for r in results]
            check(name, got, want, f"{name} {schedule} on 2 processes")
