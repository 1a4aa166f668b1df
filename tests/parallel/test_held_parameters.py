"""The parameters a user holds are the ones trained (issue 55): an optimizer built over the
model's parameters before the ``Pipeline`` (as nanoGPT's and transformers' scripts build
it), or over ``pipe.parameters()`` before the first step, ends at exactly the values of one
built over ``pipe.parameters()`` after the first step, on every layout, and at the unsplit
model's (trained on one process by the same AdamW) within rounding.

The layouts, in one 4-process gloo world: a transformers Llama built on the meta device
and captured by torch.export on its first batch (pp 2 x dp 2), a layer list (pp 2 x dp 2),
a torch.fx-traced model with a tied embedding (pp 2 x dp 2), FSDP (pp 2 x dp 2, compiled
too), tensor parallelism (the GPT example's tp_plan, pp 2 x tp 2), experts over ep (a tiny
Mixtral, pp 2 x dp 2 x ep 2), vocabulary rows (pp 2 x dp 2). Where the layout replaces the
model's parameter objects (sharding), the optimizer built before held none of the
pipeline's until its first step. Two AdamW steps each.

An optimizer that has state for parameters a pipeline replaced (it stepped them on the
unsplit model, or through an earlier pipeline over the same model) is refused at its
step, in one sentence, with nothing changed; one built before an earlier pipeline and
never stepped follows the newest split.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.losses import TokenCrossEntropy
from conveyor.partition.resplit import HELD
from tests.support import distributed
from tests.support.captures import captured
from tests.support.helpers import assert_close, mse, tied_names
from tests.support.models import batch, mlp
from tests.vocab.models import TinyGPT, padded_batch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402  (examples/gpt.py: the GPT example and its tensor-parallel plan)

LR = 1e-2
VARIANTS = ("model", "pipe", "after")  # where the optimizer is built (module doc)
TOKENS = TokenCrossEntropy(shift=True)


def _tokens(rows: int, length: int, seed: int, vocab: int = 37) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _llama(meta: bool) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        use_cache=False,
    )  # fmt: skip
    if not meta:
        with conveyor.empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config)
        return conveyor.materialize(model, init_seed=0)
    with conveyor.empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config)


def _mixtral() -> nn.Module:
    from tests.parallel.test_moe_pipeline import model_of

    return model_of("mixtral", False)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(vocab=11, context=8, width=16, depth=2, heads=4)


def _tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(True)


def _mlp() -> nn.Module:
    return mlp(layers=4)


@dataclass(frozen=True)
class Case:
    """One layout: its model, context, pipeline keywords and two batches (whole)."""

    name: str
    model: Callable[[], nn.Module]
    layout: dict[str, int]
    options: dict[str, Any]
    batches: list[tuple[Any, Any]]
    kind: str  # how the unsplit model's loss is computed: "mse", "tokens", "own"
    replaces: bool = False  # the layout replaces the model's parameter objects
    capture: bool = False  # captured by torch.export (in the test process, for the ranks)
    variants: tuple[str, ...] = ("model", "after")
    reference: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _x(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(8, seed)


def _gpt_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (4, 9), generator=g)
    return ids[:, :-1], ids[:, 1:].clone()


PP_DP = {"pp": 2, "dp": 2}
CASES = [
    Case("meta llama", lambda: _llama(True), PP_DP, {"loss_fn": None, "weights": None},
         [(_tokens(4, 8, s), None) for s in (1, 2)], "own", capture=True, variants=VARIANTS),
    Case("layer list", _mlp, PP_DP, {"loss_fn": mse}, [_x(1), _x(2)], "mse"),
    Case("fx", _tiny_gpt, PP_DP, {"loss_fn": TOKENS}, [padded_batch(4, 7, s) for s in (1, 2)],
         "tokens"),
    Case("fsdp", _mlp, PP_DP, {"loss_fn": mse, "fsdp": True}, [_x(1), _x(2)], "mse",
         replaces=True),
    Case("fsdp compiled", _mlp, PP_DP, {"loss_fn": mse, "fsdp": True, "compile": True},
         [_x(1), _x(2)], "mse", replaces=True),
    Case("tp", _gpt, {"pp": 2, "tp": 2}, {"loss_fn": TokenCrossEntropy(), "tp_plan": gpt.tp_plan()},
         [_gpt_batch(1), _gpt_batch(2)], "tokens", replaces=True, reference=False),
    Case("ep", _mixtral, {"pp": 2, "dp": 2, "ep": 2}, {"loss_fn": None},
         [(_tokens(4, 7, s), None) for s in (1, 2)], "own", replaces=True, capture=True,
         reference=False),
    Case("vocab", _tiny_gpt, PP_DP, {"loss_fn": TOKENS, "vocab_parallel": True},
         [padded_batch(4, 7, s) for s in (1, 2)], "tokens", replaces=True),
]  # fmt: skip


def _rows(value: Any, ctx: Any) -> Any:
    """This replica's rows (round-robin) of a batch: a tensor or a dict of tensors."""
    mine = slice(ctx.dp_rank, None, ctx.dp_size)
    if isinstance(value, dict):
        return {k: v[mine] for k, v in value.items()}
    return value if value is None else value[mine]


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def _train(case: Case, model: nn.Module, variant: str, ctx: Any) -> dict[str, Any]:
    """Two AdamW steps of ``model`` through a pipeline, the optimizer built per ``variant``."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if variant == "model" else None
    shape = _shape(model)
    pipe = conveyor.Pipeline(model, microbatches=2, context=ctx, **case.options)
    if variant == "pipe":
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    out: dict[str, Any] = {"losses": []}
    for step, (inputs, targets) in enumerate(case.batches):
        loss = pipe.train_step(_rows(inputs, ctx), _rows(targets, ctx))
        out["losses"].append(float(loss))
        if opt is None:
            opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        if step == 0:
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            out["held before"] = sum(id(p) in held for p in pipe.parameters())
        opt.step()
        opt.zero_grad()
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    out["held after"] = all(id(p) in held for p in pipe.parameters())
    out["count"] = len(list(pipe.parameters()))
    out["params"] = {n: _whole(p) for n, p in pipe.named_parameters()}
    out["modules untouched"] = _shape(model) == shape
    return out


def _shape(model: nn.Module) -> dict[str, Any]:
    """Per module of the user's model: its class, attribute names (but the one the
    pipeline documents, ``conveyor_held``) and the sizes of its tables (hooks, parameters,
    buffers): what FSDP, tensor parallelism, the expert routing or compiling would
    change, if done on the user's module."""
    return {
        name: (type(m), sorted(set(vars(m)) - {HELD}),
               [len(v) for _, v in sorted(vars(m).items()) if isinstance(v, (dict, set))])
        for name, m in model.named_modules()
    }  # fmt: skip


def _refusals(ctx: Any) -> dict[str, Any]:
    """An optimizer with state for replaced parameters is refused (nothing changes); one
    built before an earlier pipeline and never stepped follows the newest split."""
    out: dict[str, Any] = {}
    x, y = _x(1)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    mse(model(x), y).backward()  # a step of the unsplit model: the optimizer has state
    opt.step()
    opt.zero_grad()
    pipe = conveyor.Pipeline(model, loss_fn=mse, microbatches=2, context=ctx, fsdp=True)
    pipe.train_step(_rows(x, ctx), _rows(y, ctx))
    before = {n: _whole(p) for n, p in pipe.named_parameters()}
    try:
        opt.step()
        out["stepped"] = None
    except conveyor.ConfigError as error:
        out["stepped"] = str(error)
    out["unchanged"] = all(torch.equal(_whole(p), before[n]) for n, p in pipe.named_parameters())
    # an earlier pipeline's optimizer after a new split over the same model
    model = _mlp()
    never = torch.optim.AdamW(model.parameters(), lr=LR)  # built before both, never stepped
    first = conveyor.Pipeline(model, loss_fn=mse, microbatches=2, context=ctx, fsdp=True)
    old = torch.optim.AdamW(first.parameters(), lr=LR)
    first.train_step(_rows(x, ctx), _rows(y, ctx))
    old.step()
    old.zero_grad()
    second = conveyor.Pipeline(model, loss_fn=mse, microbatches=2, context=ctx, fsdp=True)
    second.train_step(_rows(x, ctx), _rows(y, ctx))
    try:
        old.step()
        out["old"] = None
    except conveyor.ConfigError as error:
        out["old"] = str(error)
    never.step()
    held = {id(p) for g in never.param_groups for p in g["params"]}
    out["never follows"] = all(id(p) in held for p in second.parameters())
    return out


def _world(rank: int, models: dict[tuple[str, str], nn.Module]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        ctx = conveyor.init(**case.layout)
        for variant in case.variants:
            model = models.get((case.name, variant)) or case.model()
            out[case.name, variant] = _train(case, model, variant, ctx)
    out["refusals"] = _refusals(conveyor.init(**PP_DP))
    return out


def _unsplit(case: Case) -> dict[str, torch.Tensor]:
    """The unsplit model's parameters after the same two AdamW steps on whole batches."""
    model = _llama(False) if case.name == "meta llama" else case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for inputs, targets in case.batches:
        if case.kind == "own":
            loss = model(**inputs).loss
        elif case.kind == "tokens":
            total, count = (TOKENS if case.name != "tp" else TokenCrossEntropy())(
                model(inputs), targets
            )
            loss = total / count
        else:
            loss = mse(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_optimizer_built_before_the_split_trains_what_one_built_after_does() -> None:
    models: dict[tuple[str, str], nn.Module] = {}
    for case in CASES:
        if case.capture:  # one export here instead of one per rank
            for variant in case.variants:
                first = case.batches[0][0]
                models[case.name, variant] = captured(case.model(), _rows(first, _Half()), 2)
    results = distributed.run(_world, 4, models, fork=True, timeout=900)
    for case in CASES:
        want = _unsplit(case) if case.reference else None
        aliases = tied_names(_llama(False) if case.name == "meta llama" else case.model())
        for rank, got in enumerate(results):
            after = got[case.name, "after"]
            assert after["held after"] and after["count"], (case.name, rank)
            for variant in case.variants:
                run = got[case.name, variant]
                what = f"{case.name}, optimizer built over {variant}, rank {rank}"
                assert run["held after"], what  # it stepped every parameter the rank trains
                assert run["modules untouched"], what
                assert run["losses"] == after["losses"], what
                for name, value in run["params"].items():
                    assert torch.equal(value, after["params"][name]), (what, name)
                if variant == "model" and case.replaces:  # its first step had to point it
                    assert run["held before"] < run["count"], what
                if want is not None:
                    table = {n: want[aliases[n]] for n in run["params"]}
                    assert_close(run["params"], table, what)
    for rank, got in enumerate(results):
        refusals = got["refusals"]
        sentence = refusals["stepped"]  # names this rank's parameters
        assert sentence is not None and sentence.count("; ") == 1, (rank, sentence)
        assert "has state for" in sentence and "pipe.parameters()" in sentence, sentence
        assert refusals["unchanged"], rank
        assert refusals["old"] is not None and "has state for" in refusals["old"], rank
        assert refusals["never follows"], rank


class _Half:
    """Replica 0 of 2 (the rows stage 0's rank captures on)."""

    dp_rank, dp_size = 0, 2
