"""Token-averaged losses over padded, variable-length rows are the WHOLE batch's.

The reference is always the unsplit model's loss over the whole (global) batch: the summed
token loss divided by the batch's count of real tokens, never a mean of micro-batch means.
Rows differ in real tokens by 12x, micro-batches and replica shares are uneven.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.errors import ConfigError, PipelineError
from conveyor.losses import TokenCrossEntropy
from conveyor.schedules.registry import SCHEDULE_NAMES, default_chunks
from tests.support import distributed
from tests.support.helpers import assert_close, grads_of, merge

VOCAB, DIM, LENGTH = 13, 16, 12
# Real (not ignore_index) tokens per row: 12x apart, and rows of one micro-batch differ.
REAL = [12, 1, 8, 3, 10, 2, 6, 1, 9, 5]


class Block(nn.Module):
    """A layer with parameters (every stage of an automatic split gets some)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


def lm() -> nn.Sequential:
    """A tiny language model as a layer list of 8 layers with parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), *[Block() for _ in range(6)],
                         nn.Linear(DIM, VOCAB))  # fmt: skip


def tokens(
    rows: int = 10, seed: int = 0, length: int = LENGTH
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rows`` rows; targets past each row's real tokens are -100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (rows, length), generator=g)
    y = torch.randint(0, VOCAB, (rows, length), generator=g)
    for i in range(rows):
        y[i, min(REAL[i % len(REAL)], length) :] = -100
    return x, y


def token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean over real tokens: the unsplit model's loss on a whole batch."""
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)


def reference(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict[str, Any]]:
    """The unsplit model's loss and gradients over ALL ``pairs`` together: summed token
    losses over the total count of real tokens."""
    model = lm()
    total = sum(
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
        for x, y in pairs
    )
    count = sum(int(y.ne(-100).sum()) for _, y in pairs)
    loss = total / count
    loss.backward()
    return loss.item(), grads_of(model.named_parameters())


def _every_schedule(pp: int, m: int) -> list[tuple[str, int]]:
    names = [n for n in SCHEDULE_NAMES if not (n == "dualpipev" and m < 2 * pp - 1)]
    return [(n, default_chunks(n)) for n in names]


# ------------------------------------------------------------------- one process, every schedule
@pytest.mark.parametrize("name,chunks", _every_schedule(2, 4))
def test_pair_loss_is_the_whole_batch_token_mean(name: str, chunks: int) -> None:
    """10 rows in 4 micro-batches (3, 3, 2, 2), pp=2 in one process: fails on a mean per
    micro-batch weighted by rows (88% off on the worst gradient)."""
    x, y = tokens()
    want_loss, want_grads = reference([(x, y)])
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=4,
                             schedule=name, chunks=chunks)  # fmt: skip
    loss = pipe.train_step(x, y)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), want_grads, name)


def test_recompute_counts_each_micro_batch_once() -> None:
    """The last stage's recompute runs the loss again at B: its total must not be added
    to the step's loss twice, and its gradient must be the same."""
    x, y = tokens()
    want_loss, want_grads = reference([(x, y)])
    conveyor.init(pp=2)
    for name in ("1f1b", "zb-h1"):
        pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=4,
                                 schedule=name, recompute=True)  # fmt: skip
        assert pipe.train_step(x, y).item() == pytest.approx(want_loss, rel=1e-6)
        assert_close(grads_of(pipe.named_parameters()), want_grads, f"{name} recompute")


def test_a_scalar_mean_per_micro_batch_is_weighted_by_rows() -> None:
    """A scalar loss keeps its meaning (a mean over rows, weighted by rows): for token
    losses that is NOT the whole batch's token mean, which is why the pair exists."""
    x, y = tokens()
    want_loss, _ = reference([(x, y)])
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=token_mean, microbatches=4)
    got = pipe.train_step(x, y).item()
    model = lm()
    parts = zip(x.tensor_split(4), y.tensor_split(4), strict=True)
    means = [token_mean(model(a), b).item() for a, b in parts]
    rows = [3, 3, 2, 2]
    assert got == pytest.approx(sum(v * r for v, r in zip(means, rows, strict=True)) / 10, rel=1e-6)
    assert abs(got - want_loss) > 1e-3  # the data make the two clearly differ


def test_label_smoothing_and_shift_match_cross_entropy() -> None:
    out = torch.randn(3, 7, VOCAB)
    _, y = tokens(3, length=7)
    total, count = TokenCrossEntropy(label_smoothing=0.1)(out, y)
    want = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), label_smoothing=0.1)
    assert count.dtype == torch.int64 and int(count) == int(y.ne(-100).sum())
    assert (total / count).item() == pytest.approx(want.item(), rel=1e-6)
    total, count = TokenCrossEntropy(shift=True)(out, y)
    want = F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1))
    assert (total / count).item() == pytest.approx(want.item(), rel=1e-6)


def test_another_ignore_index_is_the_one_not_counted() -> None:
    """``ignore_index=0`` (padding as token 0, and -100 a label never seen): the count and
    the gradients are ``F.cross_entropy(..., ignore_index=0)``'s (counting -100 instead
    gives 0.43x the loss)."""
    x, y = tokens()
    y = torch.where(y == -100, 0, y.clamp(min=1))
    model = lm()
    want = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=0)
    want.backward()
    want_grads = grads_of(model.named_parameters())
    _, count = TokenCrossEntropy(ignore_index=0)(torch.randn(10, LENGTH, VOCAB), y)
    assert int(count) == int(y.ne(0).sum()) == sum(min(r, LENGTH) for r in REAL)
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(ignore_index=0), microbatches=4)
    assert pipe.train_step(x, y).item() == pytest.approx(want.item(), rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), want_grads, "ignore_index=0")


# --------------------------------------------------------------- micro-batches cut by the user
def test_microbatches_cut_by_length_are_exact() -> None:
    """Bucketed by length: each micro-batch has its own sequence length and rows."""
    cut = [tokens(3, seed=1, length=12), tokens(1, seed=2, length=4),
           tokens(4, seed=3, length=7), tokens(2, seed=4, length=10)]  # fmt: skip
    want_loss, want_grads = reference(cut)
    conveyor.init(pp=2)
    for name in ("1f1b", "zbv"):
        pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=4,
                                 schedule=name, chunks=default_chunks(name))  # fmt: skip
        assert pipe.train_step(microbatches=cut).item() == pytest.approx(want_loss, rel=1e-6)
        assert_close(grads_of(pipe.named_parameters()), want_grads, name)
        assert pipe.eval_step(microbatches=cut).item() == pytest.approx(want_loss, rel=1e-6)


def test_bad_microbatches_get_one_sentence() -> None:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    x, y = tokens(4)
    with pytest.raises(ConfigError, match="exactly 2"):
        pipe.train_step(microbatches=[(x, y)])
    with pytest.raises(ConfigError, match="not both"):
        pipe.train_step(x, y, microbatches=[(x, y), (x, y)])
    with pytest.raises(ConfigError, match="pair"):
        pipe.train_step(microbatches=[(x, y), [x, y]])
    with pytest.raises(ConfigError, match="3 target rows"):
        pipe.train_step(microbatches=[(x, y[:3]), (x, y)])


# ------------------------------------------------------------------------------ accumulation
def test_accumulated_steps_divide_by_the_count_of_all_of_them() -> None:
    """Two batches, one optimizer step: ``count=`` (every batch's tokens) makes the
    accumulated gradient that of the two batches' token mean."""
    first, second = tokens(6, seed=5), tokens(4, seed=6)
    want_loss, want_grads = reference([first, second])
    count = int(first[1].ne(-100).sum() + second[1].ne(-100).sum())
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    losses = [pipe.train_step(*first, count=count), pipe.train_step(*second, count=count)]
    assert sum(v.item() for v in losses) == pytest.approx(want_loss, rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), want_grads, "accumulated")


# --------------------------------------------------------------------------------- bad input
def test_a_batch_with_nothing_to_count_raises_and_leaves_gradients() -> None:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    x, y = tokens(4)
    pipe.train_step(x, y)
    before = grads_of(pipe.named_parameters())
    with pytest.raises(ConfigError, match="no item to average over"):
        pipe.train_step(x, torch.full_like(y, -100))
    after = grads_of(pipe.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def _float_count(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total, count = TokenCrossEntropy()(out, y)
    return total, count.float()


def test_a_count_that_is_not_an_integer_is_refused() -> None:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=_float_count, microbatches=2)
    with pytest.raises(PipelineError, match="must be an integer"):
        pipe.train_step(*tokens(4))


def test_pairs_and_scalars_mixed_in_one_step_are_refused() -> None:
    calls = [0]

    def mixed(out: torch.Tensor, y: torch.Tensor) -> Any:
        calls[0] += 1
        return TokenCrossEntropy()(out, y) if calls[0] % 2 else token_mean(out, y)

    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=mixed, microbatches=2)
    with pytest.raises(PipelineError, match=r"pair .* on some micro-batches and a scalar"):
        pipe.train_step(*tokens(4))


# --------------------------------------------------------------- a transformers causal LM
def _llama_batch() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from tests.support.real_models import VOCAB as V
    from tests.support.real_models import llama

    model, _, _ = llama(layers=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (6, 10), generator=g)
    labels = ids.clone()
    for i, real in enumerate([10, 2, 7, 1, 9, 4]):
        labels[i, real:] = -100
    return model, {"input_ids": ids, "labels": labels}


@pytest.mark.slow
def test_transformers_causal_lm_loss_is_the_whole_batch() -> None:
    """loss_fn=None: ``model(**batch).loss`` of the whole padded batch, gradients too
    (25% off with micro-batch means weighted by rows)."""
    model, batch = _llama_batch()
    want = model(**batch).loss
    want.backward()
    want_grads = grads_of(model.named_parameters())
    model.zero_grad()
    conveyor.init(pp=2)
    for name in ("1f1b", "zb-h1"):
        for p in model.parameters():
            p.grad = None
        pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=4, schedule=name)
        assert pipe.train_step(batch, None).item() == pytest.approx(want.item(), rel=1e-5)
        assert_close(grads_of(pipe.named_parameters()), want_grads, name)


def _unsplit_then_pp2(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's own loss on the whole batch, then a pp=2 pipeline of 3 micro-batches
    on it with ``loss_fn=None``: the loss is asserted equal; returns (pipeline gradients,
    unsplit gradients)."""
    want = model(**batch).loss
    want.backward()
    want_grads = grads_of(model.named_parameters())
    for p in model.parameters():
        p.grad = None
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=3)
    assert pipe.train_step(batch, None).item() == pytest.approx(want.item(), rel=1e-5)
    return grads_of(pipe.named_parameters()), want_grads


def test_a_micro_batch_without_a_counted_token_adds_nothing() -> None:
    """loss_fn=None, 3 micro-batches of 2 rows, the middle one all padding: its own mean is
    NaN, yet the step's loss and gradients are the whole batch's (not NaN)."""
    model, batch = _llama_batch()
    batch["labels"][2:4] = -100
    got, want_grads = _unsplit_then_pp2(model, batch)
    assert_close(got, want_grads, "empty micro-batch")


def test_a_masked_lm_counts_every_labelled_position() -> None:
    """loss_fn=None on ``BertForMaskedLM``: its loss does not shift, so a label at position
    0 counts (a shifting count is 7.8% off); rows label 1 to 4 positions."""
    import transformers as T

    torch.manual_seed(0)
    config = T.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    model = T.BertForMaskedLM(config)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (6, 8), generator=g)
    labels = torch.full_like(ids, -100)
    for row, positions in enumerate([[0], [0, 3], [5], [0, 1, 2, 7], [0], [4, 6]]):
        labels[row, positions] = ids[row, positions]
    got, want_grads = _unsplit_then_pp2(model, {"input_ids": ids, "labels": labels})
    got["cls.predictions.bias"] = got.pop("cls.predictions.decoder.bias")  # one tensor
    assert_close(got, want_grads, "masked LM")


# ------------------------------------------------------------------------- several processes
def _pipelines(rank: int, pp: int, dp: int, fsdp: bool, names: list[str]) -> dict[str, Any]:
    """Per schedule: this rank's loss and gradients on its replica's uneven share (global
    batches of 10 rows in 4 micro-batches, 9 rows over 2 replicas)."""
    ctx = conveyor.init(pp=pp, dp=dp, timeout=60)
    x, y = tokens(10 if dp == 1 else 9)
    if dp > 1:
        share = slice(0, 5) if ctx.dp_rank == 0 else slice(5, 9)
        x, y = x[share], y[share]
    out = {}
    for name in names:
        pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), schedule=name,
                                 microbatches=4 if dp == 1 else 2, chunks=default_chunks(name),
                                 context=ctx, fsdp=fsdp)  # fmt: skip
        loss = pipe.train_step(x, y).item()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in pipe.named_parameters()
            if p.grad is not None
        }
        out[name] = (loss, grads if ctx.dp_rank == 0 and ctx.tp_rank == 0 else {})
    return out


def _check(results: list[dict[str, Any]], rows: int, names: list[str]) -> None:
    want_loss, want_grads = reference([tokens(rows)])
    for name in names:
        for loss, _ in (r[name] for r in results):
            assert loss == pytest.approx(want_loss, rel=1e-6), name
        assert_close(merge([r[name][1] for r in results]), want_grads, name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_every_schedule() -> None:
    names = [n for n, _ in _every_schedule(2, 4)]
    _check(distributed.run(_pipelines, 2, 2, 1, False, names, timeout=200, fork=True), 10, names)


FAMILIES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_pp2_dp2_uneven_replicas(fsdp: bool) -> None:
    """9 rows over 2 replicas (5 / 4) with different token counts: the replicas' losses
    and gradients combine into the global batch's (dropping FSDP's replica weighting, or
    weighting replicas by rows, is off by percents here)."""
    names = [n for n in FAMILIES if n != "dualpipev"]  # m = 2 per replica
    _check(distributed.run(_pipelines, 4, 2, 2, fsdp, names, timeout=200, fork=True), 9, names)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_four_pipeline_ranks() -> None:
    names = ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"]
    _check(distributed.run(_pipelines, 4, 4, 1, False, names, timeout=200, fork=True), 10, names)


# ------------------------------------------------------------------------------ the Trainer
def test_trainer_fits_and_evaluates_token_weighted() -> None:
    """``fit`` with a pair loss: the step's loss is its global batch's token mean, and the
    evaluation loss is the token mean over the WHOLE evaluation set, not a mean of the
    batches' means (4 evaluation batches of 3, 3, 3 and 1 rows)."""
    x, y = tokens(10)
    want, _ = reference([(x, y)])
    data = torch.utils.data.TensorDataset(x, y)
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    history = conveyor.Trainer(pipe, torch.optim.SGD(pipe.parameters(), lr=0.0)).fit(
        data, batch_size=10, epochs=1, eval_data=torch.utils.data.DataLoader(data, batch_size=3)
    )
    assert history.losses == [pytest.approx(want, rel=1e-6)]  # one batch: all 10 rows
    assert history.evals[-1]["loss"] == pytest.approx(want, rel=1e-6)  # lr 0: same model
    model = lm()
    means = [token_mean(model(a), b).item() for a, b in zip(x.split(3), y.split(3), strict=True)]
    assert abs(sum(means) / len(means) - want) > 1e-2  # batch means would be far off


def _hits(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's mean over rows of each row's right guesses (a row's real tokens)."""
    return (out.argmax(-1) == y).sum(-1).float().mean()


def test_metrics_with_a_pair_loss_are_means_over_samples() -> None:
    """``fit(metrics=...)`` beside a token loss: a metric is the mean over the evaluation
    samples of the batch means it returns, weighted by rows (not by counted tokens, 5.7x
    fewer here)."""
    x, y = tokens(10)
    data = torch.utils.data.TensorDataset(x, y)
    model = lm()
    sizes = [3, 3, 3, 1]
    means = [_hits(model(a), b).item() for a, b in zip(x.split(3), y.split(3), strict=True)]
    want = sum(m * n for m, n in zip(means, sizes, strict=True)) / 10
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    trainer = conveyor.Trainer(pipe, torch.optim.SGD(pipe.parameters(), lr=0.0))
    history = trainer.fit(
        data, batch_size=10, epochs=1, metrics={"hits": _hits},
        eval_data=torch.utils.data.DataLoader(data, batch_size=3),
    )  # fmt: skip
    assert want > 0.1  # the ratio shows
    assert history.evals[-1]["hits"] == pytest.approx(want, rel=1e-6)


def test_gradients_of_earlier_steps_are_kept_apart_only_when_needed() -> None:
    """A scalar loss accumulates in place (no copy of the gradients held aside), a pair
    loss's step is scaled alone; switching kinds with gradients held is refused."""
    x, y = tokens()
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(lm(), loss_fn=token_mean, microbatches=2)
    pipe.train_step(x, y)
    first = {n: p.grad for n, p in pipe.named_parameters()}
    pipe.train_step(x, y)
    assert all(p.grad is first[n] for n, p in pipe.named_parameters())  # accumulated in place
    pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=2)
    pipe.train_step(x, y)
    once = grads_of(pipe.named_parameters())
    pipe.train_step(x, y)
    assert_close(grads_of(pipe.named_parameters()), {n: 2 * g for n, g in once.items()}, "twice")
    pair = [False]

    def switching(out: torch.Tensor, target: torch.Tensor) -> Any:
        return TokenCrossEntropy()(out, target) if pair[0] else token_mean(out, target)

    switched = conveyor.Pipeline(lm(), loss_fn=switching, microbatches=2)
    switched.train_step(x, y)
    pair[0] = True  # the loss turns into a pair while the scalar steps' gradients are held
    with pytest.raises(PipelineError, match=r"pairs .* in this step but scalars in earlier"):
        switched.train_step(x, y)


def test_autocast_pair_loss_is_the_whole_batch_token_mean() -> None:
    """Under bf16 autocast the totals are summed in float32 and divided by the whole
    batch's count: the unsplit model's autocast loss, to bf16 rounding."""
    x, y = tokens()
    model = lm()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = token_mean(model(x).float(), y).item()
    conveyor.init(pp=2)
    for name in ("1f1b", "zbv"):
        pipe = conveyor.Pipeline(lm(), loss_fn=TokenCrossEntropy(), microbatches=4,
                                 schedule=name, autocast=torch.bfloat16)  # fmt: skip
        loss = pipe.train_step(x, y)
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(want, rel=1e-5), name  # rows would be 1.7% off
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in pipe.parameters())  # fmt: skip


def test_a_scalar_loss_accumulates_by_count_too() -> None:
    """``count=`` with a mean over rows: two steps of 6 and 4 rows divided by 10 rows are
    the mean over the 10 rows (the step's own gradients are scaled apart)."""
    x, y = torch.randn(10, 4), torch.randn(10, 4)

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    model = net()
    F.mse_loss(model(x), y).backward()
    want = grads_of(model.named_parameters())
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(net(), loss_fn=F.mse_loss, microbatches=2)
    losses = [pipe.train_step(x[:6], y[:6], count=10), pipe.train_step(x[6:], y[6:], count=10)]
    assert sum(v.item() for v in losses) == pytest.approx(F.mse_loss(net()(x), y).item(), rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), want, "scalar accumulated by count")
