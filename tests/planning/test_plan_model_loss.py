"""``schedule="auto"`` for a model that computes its own loss (``loss_fn=None``): the planner
profiles the model's own loss, weighs vocabulary parallelism for it, and the pipeline it
builds trains exactly; and the planner takes vocabulary parallelism for exactly the losses
the runtime takes (one rule: :func:`conveyor.vocab.setup.vocab_loss`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import conveyor
from conveyor.errors import ConfigError
from conveyor.losses import ModelTokenLoss, TokenCrossEntropy
from conveyor.planning.vocab import takes_loss, vocab_units
from conveyor.vocab.layers import find_vocab_layers
from conveyor.vocab.setup import vocab_loss
from tests.support import distributed
from tests.support.helpers import assert_close_to_largest
from tests.support.steady import steady_profile as steady
from tests.vocab.models import TinyGPT

transformers = pytest.importorskip("transformers")

SCHEDULES = ["1f1b", "zb-h1"]
TOL = 1e-5


def llama(vocab: int, hidden: int = 32) -> torch.nn.Module:
    """A 2-layer transformers Llama from a config (no weights downloaded)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().train()


def batch(vocab: int, rows: int = 8, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and labels: row r has r % 4 padded positions (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    for r in range(rows):
        if r % 4:
            labels[r, length - r % 4 :] = -100
    return {"input_ids": ids, "labels": labels}


def reference(vocab: int, batches: list[dict[str, torch.Tensor]]) -> list[tuple[float, Any]]:
    """The unsplit model's whole-batch loss and gradients per step, SGD between steps."""
    model = llama(vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def train(pipe: conveyor.Pipeline, batches: list[dict[str, torch.Tensor]]) -> list[Any]:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = []
    for b in batches:
        loss = float(pipe.train_step(b, None))
        grads = {}
        for n, p in pipe.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
        out.append((loss, grads))
        opt.step()
        opt.zero_grad()
    return out


def check(got: list[Any], want: list[Any], what: str, every: bool = True) -> None:
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(want_loss, rel=TOL), (what, step, loss, want_loss)
        # (a gradient that is zero up to rounding is measured against the largest)
        assert_close_to_largest(grads, {n: want_grads[n] for n in grads}, f"{what} {step}")
    if every:
        assert set(got[0][1]) == set(want[0][1]), what


# ----------------------------------------------------------------------------- the rule
def test_the_planner_takes_exactly_the_losses_the_runtime_takes() -> None:
    """For each loss and model: the planner's predicate and vocab_loss agree, and the
    planner's vocabulary units exist exactly where the loss is taken."""
    models = {"llama": llama(64), "gpt": TinyGPT()}
    plain = torch.nn.functional.cross_entropy
    taken = {}
    for kind, model in models.items():
        layers = find_vocab_layers(model, True)
        cut = [model]  # one unit holding every layer (no capture needed to find them)
        losses: dict[str, Any] = {
            "TokenCrossEntropy()": TokenCrossEntropy(),
            "TokenCrossEntropy(shift)": TokenCrossEntropy(shift=True),
            "TokenCrossEntropy(ignore_index=0, label_smoothing=0.1)": TokenCrossEntropy(
                ignore_index=0, label_smoothing=0.1
            ),
            "ModelTokenLoss": ModelTokenLoss(models["llama"], True),
            "None": None,
            "a plain function": plain,
        }
        for name, loss in losses.items():
            try:
                vocab_loss(loss, layers)
                runtime = True
            except ConfigError:
                runtime = False
            assert takes_loss(loss, layers) == runtime, (kind, name)
            assert (vocab_units(model, cut, loss) is not None) == runtime, (kind, name)
            taken[kind, name] = runtime
    # what the rule says today (the runtime's), for the record
    assert taken["llama", "None"] and taken["llama", "ModelTokenLoss"]
    assert not taken["gpt", "None"] and not taken["gpt", "ModelTokenLoss"]
    assert not taken["llama", "a plain function"] and not taken["gpt", "a plain function"]
    assert all(taken[k, "TokenCrossEntropy(shift)"] for k in models)


# ----------------------------------------------------------------------------- one process
@pytest.mark.slow
def steady_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's unit times made proportional to each unit's parameters (its memory
    stays measured), so that its choice does not follow a loaded machine's timing noise."""
    steady(monkeypatch, lambda unit: 1e-6 + unit.parameters * 1e-9)


# in the slow lane: it profiles a transformers model, about 3.5 s
@pytest.mark.slow
def test_the_plan_weighs_vocabulary_parallelism_for_the_models_own_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """loss_fn=None on a Llama: both kinds of split are candidates; the vocabulary split
    wins where the vocabulary dwarfs the hidden size, the plain one where it does not.

    Each unit's measured times are replaced by times proportional to its parameters (the
    memory stays measured): timed on a loaded machine, the 65536-row choice flipped once
    in a fresh clone's run."""
    steady_profile(monkeypatch)
    picked = {}
    for vocab in (64, 65536):
        model, b = llama(vocab), batch(vocab)
        plan = conveyor.plan(model, b, None, None, ranks=2, microbatch_counts=[4],
                             schedules=SCHEDULES, calibrate=False)  # fmt: skip
        kinds = {(c.schedule, c.vocab) for c in plan.alternatives}
        assert kinds == {(s, v) for s in SCHEDULES for v in (False, True)}, vocab
        picked[vocab] = plan.vocab_parallel
    assert picked == {64: False, 65536: True}


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [64, 65536])
def test_schedule_auto_with_the_models_own_loss_trains_exactly(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipeline(Llama, loss_fn=None, schedule="auto") in one process running pp=2: two
    steps of padded rows (the second of another length, 6 rows over 4 micro-batches)
    against the unsplit model's loss and gradients."""
    steady_profile(monkeypatch)
    batches = [batch(vocab), batch(vocab, rows=6, length=9, seed=1)]
    want = reference(vocab, batches)
    pipe = conveyor.Pipeline(llama(vocab), loss_fn=None, microbatches=4, schedule="auto",
                             sample=(batches[0], None), context=conveyor.init(pp=2))  # fmt: skip
    assert pipe.plan is not None
    assert pipe.plan.vocab_parallel == (vocab == 65536)
    assert bool(pipe.schedule.vocab) == (vocab == 65536)
    check(train(pipe, batches), want, f"auto, vocab {vocab}")


# ----------------------------------------------------------------------------- 2 processes
def _auto(rank: int, vocab: int) -> dict[str, Any]:
    """Per run (the planner's choice; vocabulary parallelism asked for): this rank's steps,
    whether the plan weighed the vocabulary split and whether the pipeline runs it."""
    ctx = conveyor.init(pp=2)
    batches = [batch(vocab), batch(vocab, rows=6, length=9, seed=1)]
    out = {}
    for asked in (False, True):
        pipe = conveyor.Pipeline(llama(vocab), loss_fn=None, microbatches=4, schedule="auto",
                                 sample=(batches[0], None), context=ctx,
                                 vocab_parallel=asked)  # fmt: skip
        assert pipe.plan is not None
        out[asked] = dict(
            steps=train(pipe, batches), considered=any(c.vocab for c in pipe.plan.alternatives),
            vocab=bool(pipe.schedule.vocab), schedule=(pipe.schedule.name, pipe.plan.balance),
        )  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_schedule_auto_with_the_models_own_loss_on_two_processes() -> None:
    """The same on 2 processes, the plan calibrated by real steps of the model's own loss
    (its choice between the two kinds of split then follows the measured times), and with
    vocab_parallel=True asked for: every rank's gradients are the unsplit model's."""
    vocab = 65536
    batches = [batch(vocab), batch(vocab, rows=6, length=9, seed=1)]
    want = reference(vocab, batches)
    results = distributed.run(_auto, 2, vocab, fork=True, timeout=400)
    for asked in (False, True):
        for rank, got in enumerate(results):
            run = got[asked]
            assert run["considered"], (asked, rank)
            assert run["vocab"] or not asked, rank
            what = f"vocab_parallel={asked} rank {rank} {run['schedule']}"
            check(run["steps"], want, what, every=False)
        names = set().union(*(set(r[asked]["steps"][0][1]) for r in results))
        assert names == set(want[0][1]), asked
