"""The suite's one tolerance (tests/support/helpers.py's ``rounding_bound`` /
``assert_close``) passes a pipeline's gradients that differ from the unsplit model's only
by rounding, on any CPU's kernels, and still fails a wrong factor: every gradient of the GPT
example scaled by 2 or 0.5 fails, except the attention key biases', which are zero in exact
arithmetic (rounding noise on both sides)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import conveyor
from conveyor.losses import TokenCrossEntropy
from tests.support.helpers import assert_close, grads_of, rounding_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # examples/gpt.py

VOCAB, CONTEXT = 13, 8


def test_a_pipelines_gradients_pass_and_a_wrong_factor_fails() -> None:
    with conveyor.empty_weights():
        model = gpt.GPT(vocab=VOCAB, context=CONTEXT, width=16, depth=4, heads=4)
        ref = gpt.GPT(vocab=VOCAB, context=CONTEXT, width=16, depth=4, heads=4)
    conveyor.materialize(ref, init_seed=7)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (9, CONTEXT), generator=g)
    targets = torch.randint(0, VOCAB, (9, CONTEXT), generator=g)
    for i in range(9):
        targets[i, 2 + i % 6 :] = -100
    pipe = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=4,
                             context=conveyor.init(pp=2), init_seed=7)  # fmt: skip
    pipe.train_step(ids, targets)
    torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), targets.flatten()).backward()
    got = grads_of(pipe.named_parameters())
    want = {n: g for n, g in grads_of(ref.named_parameters()).items() if n in got}
    reduction = ids.numel() + 4 * 16  # the batch's tokens, the widest layer
    assert_close(got, want, "pipeline", reduction=reduction)
    bound = rounding_bound(want.values(), reduction)
    exact_zero = {n for n in want if n.endswith(".k.bias")}
    assert all(float(want[n].norm()) < bound for n in exact_zero)  # rounding noise only
    for name in sorted(set(want) - exact_zero):
        for factor in (2.0, 0.5):
            wrong = {**got, name: got[name] * factor}
            with pytest.raises(AssertionError, match="more than rounding reaches"):
                assert_close(wrong, want, f"{name} x{factor}", reduction=reduction)


def test_the_bound_follows_the_dtype_the_sums_and_the_values() -> None:
    values = [torch.full((4,), 3.0), torch.full((9,), 4.0 / 3)]  # norm 6 + 4 = sqrt(52)
    f32 = rounding_bound(values, 100)
    assert f32 == pytest.approx(100 * torch.finfo(torch.float32).eps * 52**0.5)
    assert rounding_bound(values, 200) == pytest.approx(2 * f32)
    assert rounding_bound([2 * v for v in values], 100) == pytest.approx(2 * f32)
    assert rounding_bound(values, 100, torch.bfloat16) == pytest.approx(2**16 * f32)
