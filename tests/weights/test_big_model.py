"""Models built on the meta device, in one process: ``conveyor.empty_weights``,
``conveyor.materialize`` and ``Pipeline(weights=, init_seed=)`` on layer lists, fx graphs
and transformers models (torch.export), from checkpoints of both kinds, and the errors.
What they compose with is in test_big_model_options.py, the multi-process layouts in
test_big_model_layouts.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.checkpoint import CheckpointError
from conveyor.errors import ConfigError
from conveyor.losses import TokenCrossEntropy
from tests.support.helpers import assert_close
from tests.support.zoo import CausalSelfAttention, InitGPT, TinyGPT

transformers = pytest.importorskip("transformers")


def llama(tied: bool = True, device: str | None = None) -> nn.Module:
    """A tiny Llama from its config; under ``conveyor.empty_weights`` unless ``device``."""
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if device is not None:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config)
    with conveyor.empty_weights():
        return transformers.LlamaForCausalLM(config)


def padded_tokens(rows: int = 6, length: int = 8) -> dict[str, torch.Tensor]:
    """Token rows of 2 to ``length`` real tokens: labels -100 past each row's end."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 97, (rows, length), generator=g)
    labels = ids.clone()
    for i in range(rows):
        labels[i, 2 + (3 * i) % (length - 1) :] = -100
    return {"input_ids": ids, "labels": labels}


def values(named: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named}


def assert_same_values(pipe: conveyor.Pipeline, ref: nn.Module) -> None:
    """Every parameter and buffer of the pipeline's stages equals the reference's, bit for
    bit, under its name."""
    want = {**values(ref.named_parameters(remove_duplicate=False)), **ref.state_dict()}
    got = pipe.state_dict()
    assert got, "the pipeline holds nothing"
    for name, value in got.items():
        assert torch.equal(value, want[name]), f"{name} differs"


def assert_grads_close(pipe: conveyor.Pipeline, ref: nn.Module, tokens: int) -> None:
    """Every gradient of the pipeline's stages within rounding of the reference's (sums over
    ``tokens`` and the models' widths, under 64)."""
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    got = {n: p.grad for n, p in pipe.named_parameters()}
    assert_close(got, {n: want[n] for n in got}, "gradients", reduction=tokens + 64)


# ------------------------------------------------------------------ empty_weights, materialize
def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers_real() -> None:
    with conveyor.empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        hf = llama()
    assert all(p.is_meta for p in (*model.parameters(), *hf.parameters()))
    assert not model[1].running_var.is_meta and torch.equal(model[1].running_var, torch.ones(4))
    inv_freq = hf.model.rotary_emb.inv_freq
    assert not inv_freq.is_meta and inv_freq.abs().sum() > 0
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # ties survive
    with pytest.raises(RuntimeError), conveyor.empty_weights():
        raise RuntimeError("inside")
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after an error too


def test_materialize_draws_each_module_from_its_name_and_seed() -> None:
    def build() -> nn.Sequential:
        with conveyor.empty_weights():
            return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    a = conveyor.materialize(build(), init_seed=1)
    b = conveyor.materialize(build(), init_seed=1)
    c = conveyor.materialize(build(), init_seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0].weight, c[0].weight)
    assert not torch.equal(a[0].weight, a[2].weight)  # same shape, another name
    # A module's values depend on its name only, not on what else the model holds.
    with conveyor.empty_weights():
        alone = nn.Sequential(nn.Identity(), nn.Identity(), nn.Linear(8, 8))
    conveyor.materialize(alone, init_seed=1)
    assert torch.equal(alone[2].weight, a[2].weight)
    # The module's own rule: nn.Linear's bound, LayerNorm's ones and zeros.
    assert a[0].weight.abs().max() <= 8**-0.5
    ln = conveyor.materialize(_meta(lambda: nn.LayerNorm(4)))
    assert torch.equal(ln.weight, torch.ones(4)) and torch.equal(ln.bias, torch.zeros(4))


def test_a_parent_initializing_its_child_runs_after_it() -> None:
    """nn.MultiheadAttention's own rule zeroes its out_proj's bias, as when built eagerly."""
    mha = conveyor.materialize(_meta(lambda: nn.MultiheadAttention(8, 2)))
    assert torch.equal(mha.out_proj.bias, torch.zeros(8))
    assert torch.equal(mha.in_proj_bias, torch.zeros(24))
    assert mha.in_proj_weight.abs().max() <= (6 / (24 + 8)) ** 0.5  # xavier's bound


def _meta(build: Any) -> Any:
    with conveyor.empty_weights():
        return build()


def test_materialize_follows_a_transformers_models_own_init() -> None:
    model = conveyor.materialize(llama(), init_seed=0)
    std = float(model.model.layers[0].mlp.gate_proj.weight.std())
    assert abs(std - model.config.initializer_range) < 0.2 * model.config.initializer_range
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    # Built under torch.device("meta") its rotary buffers are meta too: _init_weights
    # computes them again, to the values a real build has.
    on_meta = conveyor.materialize(llama(device="meta"), init_seed=0)
    for (n, a), (_, b) in zip(
        model.state_dict().items(), on_meta.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n


# ------------------------------------------------------------------ pipelines on meta models
def _mlp() -> nn.Sequential:
    with conveyor.empty_weights():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])


@pytest.mark.parametrize(
    ("schedule", "pp"), [("1f1b", 2), ("interleaved-1f1b", 2), ("zbv", 2), ("zb-h1", 4)]
)
def test_a_layer_list_pipeline_has_materializes_weights_and_exact_gradients(
    schedule: str, pp: int
) -> None:
    model = _mlp()
    ref = conveyor.materialize(copy.deepcopy(model), init_seed=4)
    conveyor.init(pp=pp)
    pipe = conveyor.Pipeline(model, loss_fn=F.mse_loss, microbatches=4, schedule=schedule,
                             init_seed=4)  # fmt: skip
    assert_same_values(pipe, ref)
    x, y = torch.randn(10, 16), torch.randn(10, 16)
    loss = pipe.train_step(x, y)
    want = F.mse_loss(ref(x), y)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert_grads_close(pipe, ref, x.shape[0])


def test_a_graph_split_with_tied_weights_on_one_rank() -> None:
    """fx capture; zbv puts the embedding and the tied head on rank 0 (one object)."""
    model = _meta(InitGPT)
    ref = conveyor.materialize(copy.deepcopy(model), init_seed=3)
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=3,
                             schedule="zbv", init_seed=3)  # fmt: skip
    assert_same_values(pipe, ref)
    assert model.lm_head.weight is model.tok_emb.weight and not model.tok_emb.weight.is_meta
    idx = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))
    targets = idx.clone()
    targets[::2, 3:] = -100
    pipe.train_step(idx, targets)
    F.cross_entropy(ref(idx).flatten(0, 1), targets.flatten()).backward()
    assert_grads_close(pipe, ref, idx.numel())


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_transformers_model_with_its_own_loss_on_padded_rows(tied: bool) -> None:
    """torch.export capture of a meta model; loss_fn=None counts the real tokens."""
    model = llama(tied)
    ref = conveyor.materialize(copy.deepcopy(model), init_seed=9)
    batch = padded_tokens()
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=3, schedule="zb-h1",
                             init_seed=9, sample=(batch, None))  # fmt: skip
    assert_same_values(pipe, ref)
    loss = pipe.train_step(batch)
    want = ref(**batch).loss
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert_grads_close(pipe, ref, batch["input_ids"].numel())


@pytest.mark.slow
# ------------------------------------------------------------------ weights=PATH
def test_weights_from_a_sharded_transformers_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(11)
    saved = conveyor.materialize(llama(), init_seed=11)
    with torch.no_grad():  # values no initialization would draw
        for p in saved.parameters():
            p.add_(0.02 * torch.randn_like(p))
    saved.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    batch = padded_tokens()
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2, weights=tmp_path,
                             sample=(batch, None))  # fmt: skip
    assert_same_values(pipe, saved)
    pipe.train_step(batch)
    saved(**batch).loss.backward()
    assert_grads_close(pipe, saved, batch["input_ids"].numel())
    # The unsplit model loads the same way; so does a model with real parameters.
    assert_same_values(pipe, conveyor.materialize(llama(), weights=tmp_path))
    real = llama(tied=True, device="cpu")
    conveyor.init(pp=2)
    loaded = conveyor.Pipeline(real, loss_fn=None, microbatches=2, weights=tmp_path,
                               sample=(batch, None))  # fmt: skip
    assert_same_values(loaded, saved)


def test_weights_stored_under_another_name_of_a_tie_or_without_the_base_prefix(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    saved = conveyor.materialize(llama(), init_seed=12)
    state = {k: v.clone() for k, v in saved.state_dict().items()}
    state.pop("model.embed_tokens.weight")  # the tie stored under its other name only
    save_file(state, str(tmp_path / "model.safetensors"))
    got = conveyor.materialize(llama(), weights=tmp_path)
    assert torch.equal(got.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    # A checkpoint of the base model (LlamaModel: no "model." prefix) into the causal LM.
    saved.model.save_pretrained(tmp_path / "base")
    got = conveyor.materialize(llama(), weights=tmp_path / "base")
    for n, v in saved.state_dict().items():
        assert torch.equal(got.state_dict()[n], v), n


def test_loaded_weights_do_not_stay_backed_by_the_file(tmp_path: Path) -> None:
    """safetensors maps the file: a parameter must not change when the file is rewritten."""
    from safetensors.torch import save_file

    zeros = {k: torch.zeros_like(v) for k, v in conveyor.materialize(_mlp()).state_dict().items()}
    save_file(zeros, str(tmp_path / "model.safetensors"))
    model = conveyor.materialize(_mlp(), weights=tmp_path)
    ones = {k: torch.ones_like(v) for k, v in zeros.items()}
    save_file(ones, str(tmp_path / "ones.safetensors"))
    with open(tmp_path / "model.safetensors", "r+b") as f:  # rewritten in place
        f.write((tmp_path / "ones.safetensors").read_bytes())
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())


def test_one_stored_tensor_for_two_untied_weights_gives_each_its_own_memory(
    tmp_path: Path,
) -> None:
    """A checkpoint of a tied model (the weight stored once) loaded into the same model
    untied: both weights get its value, each in memory of its own (sharing it would tie
    them behind the optimizer's back)."""

    def build(tied: bool) -> nn.Sequential:
        model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
        if tied:
            model[1].weight = model[0].weight
        return model

    torch.manual_seed(0)
    conveyor.save(build(tied=True), tmp_path)
    with conveyor.empty_weights():
        untied = build(tied=False)
    conveyor.materialize(untied, weights=tmp_path)
    embedding, output = untied[0].weight, untied[1].weight
    assert torch.equal(embedding, output)
    assert embedding.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()


def test_weights_from_a_conveyor_checkpoint_of_another_split(tmp_path: Path) -> None:
    conveyor.init(pp=2)
    first = conveyor.Pipeline(conveyor.materialize(_mlp(), init_seed=5), loss_fn=F.mse_loss,
                              microbatches=2)  # fmt: skip
    first.train_step(torch.randn(4, 16), torch.randn(4, 16))
    torch.optim.SGD(first.parameters(), lr=0.1).step()
    conveyor.save(first, tmp_path)
    conveyor.init(pp=2)  # 4 stages, not 2
    again = conveyor.Pipeline(_mlp(), loss_fn=F.mse_loss, microbatches=4,
                              schedule="interleaved-1f1b", weights=tmp_path)  # fmt: skip
    want = dict(first.named_parameters())
    for n, p in again.named_parameters():
        assert torch.equal(p, want[n]), n


# ------------------------------------------------------------------ errors
def test_a_parameter_nothing_can_initialize_is_named() -> None:
    with pytest.raises(ConfigError, match=r"pos_emb .*TinyGPT.*reset_parameters.*weights="):
        conveyor.Pipeline(_meta(TinyGPT), loss_fn=TokenCrossEntropy(), microbatches=2,
                          context=conveyor.init(pp=2))  # fmt: skip
    with pytest.raises(ConfigError, match="pos_emb"):
        conveyor.materialize(_meta(TinyGPT))


class Forgetful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.shift = nn.Parameter(torch.zeros(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)  # shift forgotten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def test_an_initialization_that_leaves_a_parameter_unset_is_named() -> None:
    with pytest.raises(ConfigError, match=r"Forgetful's initialization left shift unset"):
        conveyor.materialize(_meta(Forgetful))


def test_a_meta_buffer_nothing_computes_says_to_build_under_empty_weights() -> None:
    with torch.device("meta"):
        model = CausalSelfAttention(8, 5)  # its mask is computed in __init__
    with pytest.raises(ConfigError, match=r"mask .*conveyor\.empty_weights\(\)"):
        conveyor.materialize(model)


def test_checkpoint_errors_name_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in conveyor.materialize(_mlp()).state_dict().items()}
    lacking = {k: v for k, v in state.items() if k != "2.bias"}
    save_file(lacking, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks \['2\.bias'\]"):
        conveyor.materialize(_mlp(), weights=tmp_path)
    state["4.weight"] = torch.zeros(16, 8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"4\.weight \(16, 8\) \(the model's: \(16, 16\)\)"):
        conveyor.materialize(_mlp(), weights=tmp_path)
    neither = r"neither a conveyor checkpoint \(conveyor\.save\) nor a transformers"
    with pytest.raises(CheckpointError, match=neither):
        conveyor.materialize(_mlp(), weights=tmp_path / "nothing")
    with pytest.raises(ConfigError, match="weights must be a checkpoint path"):
        conveyor.Pipeline(_mlp(), loss_fn=F.mse_loss, microbatches=2, weights=3)  # type: ignore[arg-type]


@pytest.mark.slow
class ReadsItsWeights(nn.Module):
    """A forward that branches on a weight's value: neither fx nor a capture on the meta
    device can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) if float(self.a.weight.sum()) > 0 else self.a(x)


def test_a_meta_model_that_cannot_be_split_without_values_says_so() -> None:
    says = r"cannot split ReadsItsWeights while its parameters are on the meta device.*Sequential"
    with pytest.raises(ConfigError, match=says):
        conveyor.Pipeline(
            _meta(ReadsItsWeights), loss_fn=F.mse_loss, microbatches=2,
            context=conveyor.init(pp=2), sample=(torch.randn(4, 4), None),
        )  # fmt: skip
