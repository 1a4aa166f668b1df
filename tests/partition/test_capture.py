"""Capture with torch.export where fx cannot trace: annotations on library blocks, cuts
between blocks, the printed split, in-place operations at every cut, the first batch as
the sample, train / eval modes, and the errors a user meets."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.partition import split_model
from conveyor.partition.graph import layer_count
from conveyor.runtime import microbatch
from tests.support.helpers import assert_close, grads_of
from tests.support.real_models import InvertedResidual, has_batch_norm, shared

pytest.importorskip("transformers")


def _block_stages(pipe: conveyor.Pipeline, prefix: str) -> dict[str, set[int]]:
    """Block name (``prefix`` + index) -> the stages holding its parameters."""
    out: dict[str, set[int]] = {}
    for s, stage in enumerate(pipe.stages):
        for name, _ in stage.named_parameters():
            m = re.match(rf"({re.escape(prefix)}\d+)\.", name)
            if m:
                out.setdefault(m.group(1), set()).add(s)
    return out


# ---------------------------------------------------------------------------- annotations
@pytest.mark.slow  # over 2 s: the fast lane stays under 90 s
@pytest.mark.parametrize("style", ["attribute", "set_stage"])
def test_annotations_on_library_blocks_give_those_stages(style: str) -> None:
    model, batches, _ = shared("llama")
    block = model.model.layers[2]
    if style == "attribute":
        block.pipeline_stage = 1
    else:
        conveyor.set_stage(block, 1)
    try:
        _check_annotated(model, batches)
    finally:
        del block.pipeline_stage  # the shared model goes back unannotated


def _check_annotated(model: nn.Module, batches: Any) -> None:
    (inputs, _), (later, _) = batches()
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=3, context=ctx)
    for x in (inputs, later):  # the second step has another sequence length
        model.zero_grad(set_to_none=True)
        want_loss = model(**x).loss
        want_loss.backward()
        want = grads_of(model.named_parameters())
        model.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, None)
        assert float(loss) == pytest.approx(want_loss.item(), rel=1e-6)
        assert_close(grads_of(model.named_parameters()), want, "annotated llama")
    blocks = _block_stages(pipe, "model.layers.")
    assert blocks == {
        "model.layers.0": {0},
        "model.layers.1": {0},
        "model.layers.2": {1},
        "model.layers.3": {1},
    }
    text = str(pipe)
    assert "stage 0 on rank 0: model.embed_tokens, model.layers.0-1" in text
    assert re.search(r"stage 1 on rank 1: lm_head, model\.layers\.2-3, model\.norm", text)


# ---------------------------------------------------------------------------- cuts
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize(
    ("name", "prefixes"),
    [
        ("gpt2", ["transformer.h."]),
        ("resnet", ["layer1.", "layer2.", "layer3.", "layer4."]),
    ],
)
def test_automatic_split_cuts_only_between_blocks(name: str, prefixes: list[str], pp: int) -> None:
    model, batches, loss_fn = shared(name)
    sample = batches()[0]
    pipe = conveyor.Pipeline(
        model, loss_fn=loss_fn, microbatches=2, context=conveyor.init(pp=pp), sample=sample
    )
    for prefix in prefixes:
        for block, stages in _block_stages(pipe, prefix).items():
            assert len(stages) == 1, f"{block} is cut between stages {sorted(stages)}"
    text = str(pipe)
    assert "part of" not in text
    assert len(re.findall(r"^stage \d+ on rank \d+: ", text, re.M)) == pp


def test_print_shows_modules_parameters_and_what_crosses() -> None:
    model, batches, _ = shared("gpt2")
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=ctx)
    assert "not split yet" in repr(pipe)
    pipe.train_step(batches()[0][0], None)
    text = str(pipe)
    lines = text.splitlines()
    head = "Pipeline(1f1b, 2 ranks x 1 chunks = 2 stages, 2 micro-batches, in one process)"
    assert lines[0] == head
    assert "GPT2LMHeadModel in 2 stages (captured with torch.export, cut as a graph)" in text
    assert pipe.describe().method == "export"  # typed: what the build's checks read
    stage0 = next(line for line in lines if line.startswith("stage 0"))
    assert "transformer.h.0-1" in stage0 and "transformer.wte" in stage0
    count = sum(p.numel() for p in pipe.stages[0].parameters())
    assert f"{count / 1e3:.0f} k parameters" in stage0
    # the residual stream crosses with its shape (micro-batch 3 x sequence 8 x width 32)
    assert re.search(r"sends: .*\(transformer\.h\.1\) float32\[3, 8, 32\]", text)
    assert "tied: lm_head.weight = transformer.wte.weight (stage 0)" in text
    # the same model split again reuses its capture; the shapes shown are this run's
    again = conveyor.Pipeline(model, loss_fn=None, microbatches=3, context=ctx)
    again.train_step(batches()[0][0], None)
    assert re.search(r"sends: .*\(transformer\.h\.1\) float32\[2, 8, 32\]", str(again))
    info = pipe.describe()
    assert [s.rank for s in info.stages] == [0, 1]
    assert (
        sum(s.parameters for s in info.stages)
        == sum(p.numel() for p in model.parameters()) + model.lm_head.weight.numel()
    )  # the tied weight is held by both stages


def test_fx_split_shapes_come_from_the_first_step() -> None:
    model, batches, loss_fn = shared("resnet")
    x, y = batches()[0]
    pipe = conveyor.Pipeline(model, loss_fn=loss_fn, microbatches=2, context=conveyor.init(pp=2))
    assert re.search(r"sends: \S+ \(layer4\.0\.relu\)$", str(pipe), re.M)  # no shape yet
    pipe.train_step(x, y)
    assert re.search(r"sends: \S+ \(layer4\.0\.relu\) float32\[3, 128, 2, 2\]", str(pipe))


# ---------------------------------------------------------------------------- in-place
class InplaceTokens(nn.Module):
    """A ``**kwargs`` forward (fx cannot trace it: captured with export) and in-place
    operations everywhere: ``out +=`` residuals, ReLU(inplace=True), ``silu_``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(8), "fc": nn.Linear(8, 8), "act": nn.ReLU(True)})
            for _ in range(3)
        )
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            out = block["fc"](block["norm"](h))
            out += h
            h = block["act"](out)
        h = F.silu(self.mid(h), inplace=True)
        return self.head(h.mean(1))


class InplaceConvs(nn.Module):
    """MobileNetV3's pieces, small: a stem with an in-place Hardswish, an inverted residual
    with in-place activations, squeeze-excite and ``out += x``, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.Hardswish(True))
        self.block = InvertedResidual(8, 8, 1, nn.Hardswish)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


@pytest.mark.parametrize("name", ["tokens", "convs"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_in_place_operations_at_every_cut(name: str, schedule: str) -> None:
    g = torch.Generator().manual_seed(0)
    model: nn.Module
    if name == "tokens":
        model, x = InplaceTokens(), torch.randn(4, 5, 6, generator=g)
    else:
        model, x = InplaceConvs(), torch.randn(4, 3, 6, 6, generator=g)
    y = torch.randint(0, 3, (4,), generator=g)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # reference: the unsplit model over the same two micro-batches
    model.zero_grad(set_to_none=True)
    n = x.shape[0]
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        (F.cross_entropy(model(xs), ys) * (xs.shape[0] / n)).backward()
    want = grads_of(model.named_parameters())
    count = layer_count(model, microbatch.divide(x, 2, "x")[0])
    ctx = conveyor.init(pp=2)
    for k in range(1, count):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        pipe = conveyor.Pipeline(
            model,
            loss_fn=F.cross_entropy,
            microbatches=2,
            schedule=schedule,
            balance=[k, count - k],
            context=ctx,
            sample=(x, y),
        )
        pipe.train_step(x, y)
        got = grads_of(model.named_parameters())
        assert_close(got, want, f"{name} {schedule} cut after {k}")
    assert count > 10 and (name != "convs" or has_batch_norm(model))


# ---------------------------------------------------------------------------- first batch
def test_the_first_batch_is_the_sample() -> None:
    model, batches, _ = shared("gpt2")
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=ctx)
    everything = {n for n, _ in model.named_parameters()}
    assert {n for n, _ in pipe.named_parameters()} == everything  # the whole model until split
    with pytest.raises(conveyor.ConfigError, match=r"pipe\.stages needs the split.*sample="):
        _ = pipe.stages
    with pytest.raises(conveyor.ConfigError, match=r"split.*first batch"):
        conveyor.save(pipe, "/nonexistent/never-written")
    pipe.train_step(batches()[0][0], None)
    assert len(pipe.stages) == 2  # one process runs both ranks' stages
    # with sample=, the split exists at once
    pipe = conveyor.Pipeline(
        model, loss_fn=None, microbatches=2, context=ctx, sample=(batches()[0][0], None)
    )
    assert len(pipe.stages) == 2


def test_input_structure_and_fixed_sizes_are_checked() -> None:
    model, batches, _ = shared("gpt2")
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    inputs = batches()[0][0]
    pipe.train_step(inputs, None)
    with pytest.raises(
        conveyor.ConfigError,
        match=r"captured with inputs keywords input_ids, "
        r"labels but this step passes keywords input_ids;",
    ):
        pipe.train_step({"input_ids": inputs["input_ids"]}, None)
    # the same keys in another order are fine
    pipe.train_step({"labels": inputs["labels"], "input_ids": inputs["input_ids"]}, None)
    pipe = conveyor.Pipeline(
        FixedSize(), loss_fn=F.cross_entropy, microbatches=2, context=conveyor.init(pp=2)
    )
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 10, (4,))
    pipe.train_step(x, y)
    pipe.train_step(x[:3], y[:3])  # the batch stays free
    with pytest.raises(
        conveyor.ConfigError,
        match=r"break a condition the captured model "
        r"relies on \(Guard failed: .*== 48 \* x\.size\(\)\[0\]\)",
    ):
        pipe.train_step(torch.randn(4, 3, 5, 5), y)


class FixedSize(nn.Module):
    """Its code turns the image size into a constant (48 = 3 x 4 x 4), and branches on the
    input's rank (fx cannot trace that; export can)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(48, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.reshape(x.shape[0], 48)
        return self.b(self.a(x))


def test_dropout_follows_train_and_eval() -> None:
    import transformers as T

    torch.manual_seed(0)
    config = T.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.5,
        use_cache=False,
    )
    model = T.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (4, 8))
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    batch = {"input_ids": ids, "labels": ids}
    pipe.train_step(batch, None)  # captured in training mode
    model.eval()
    want = model(**batch).loss.item()
    assert float(pipe.eval_step(batch, None)) == pytest.approx(want, rel=1e-6)
    assert float(pipe.eval_step(batch, None)) == pytest.approx(want, rel=1e-6)
    model.train()
    noisy = {float(pipe.eval_step(batch, None)) for _ in range(3)}
    assert len(noisy) == 3  # dropout is active again


def test_a_model_captured_in_eval_mode_keeps_its_attention_dropout_for_training() -> None:
    """``from_pretrained`` returns a model in eval mode; captured so (here at construction,
    from ``sample``), its attention dropout (SDPA's ``dropout_p``, Llama's only dropout)
    must still act once the model is put in training mode."""
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=16,
        use_cache=False,
        attention_dropout=0.5,
        attn_implementation="sdpa",
    )
    model = T.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (4, 8))
    batch = {"input_ids": ids, "labels": ids}
    pipe = conveyor.Pipeline(
        model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2), sample=(batch, None)
    )
    want = model(**batch).loss.item()
    assert float(pipe.eval_step(batch, None)) == pytest.approx(want, rel=1e-6)
    model.train()
    losses = {float(pipe.train_step(batch, None)) for _ in range(3)}
    assert len(losses) == 3 and want not in losses, (losses, want)  # dropout acts


# ---------------------------------------------------------------------------- errors
def test_a_cache_in_the_output_asks_for_use_cache_false() -> None:
    import transformers as T

    config = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = T.GPT2LMHeadModel(config)  # use_cache defaults to True
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(conveyor.ConfigError, match=r"config\.use_cache = False"):
        split_model(model, 2, sample={"input_ids": ids})


def test_loss_fn_none_errors() -> None:
    model, batches, _ = shared("gpt2")
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    inputs = batches()[0][0]
    with pytest.raises(conveyor.ConfigError, match=r"targets are not used; pass the labels"):
        pipe.train_step(inputs, inputs["labels"])
    unlabelled = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=conveyor.init(pp=2))
    with pytest.raises(conveyor.ConfigError, match=r"has no loss; pass what the model needs"):
        unlabelled.train_step({"input_ids": inputs["input_ids"]}, None)


@pytest.mark.slow  # near 2 s: the fast lane stays under 90 s
def test_recompute_and_checkpoints_on_a_captured_model(tmp_path: Any) -> None:
    model, batches, _ = shared("llama")
    inputs = batches()[0][0]
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    want = grads_of(model.named_parameters())
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(
        model, loss_fn=None, microbatches=3, schedule="zb-h1", recompute=True, context=ctx
    )
    model.zero_grad(set_to_none=True)
    pipe.train_step(inputs, None)
    assert_close(grads_of(model.named_parameters()), want, "recompute")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt.step()
    conveyor.save(pipe, tmp_path, opt, step=1)
    state = conveyor.load_model_state(tmp_path)
    assert set(state) == set(model.state_dict())  # original names, tied head included
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
