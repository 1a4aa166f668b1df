"""Graph split, annotations, execution sequences: chained stages equal the unsplit model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition import (
    sequence,
    set_stage,
    shared_parameters,
    split_model,
    stage_of,
)
from tests.support.helpers import assert_close
from tests.support.helpers import max_rel_err as rel_err
from tests.support.zoo import (
    Block,
    Deep,
    Net,
    Pytree,
    Skip,
    TinyGPT,
    Untraceable,
    annotated_deep,
    net_sequence,
    tokens,
)

# ------------------------------------------------------------------ helpers


def chain(stages: list[nn.Module], inputs: Any) -> Any:
    """Run stages back to back like the runtime does (stage 0 unpacks tuples and dicts)."""
    if isinstance(inputs, tuple):
        out = stages[0](*inputs)
    elif isinstance(inputs, dict):
        out = stages[0](**inputs)
    else:
        out = stages[0](inputs)
    for stage in stages[1:]:
        out = stage(out)
    return out


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def loss_of(output: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return sum((t.float().square().mean() for t in leaves), torch.zeros(()))


def assert_same_as_model(
    model: nn.Module, stages: list[nn.Module], make_inputs: Callable[[], Any]
) -> None:
    """Forward output and every parameter's and input's gradient match the unsplit model."""
    params = dict(model.named_parameters())
    results = []
    for run in (lambda x: call(model, x), lambda x: chain(stages, x)):
        model.zero_grad(set_to_none=True)
        inputs = make_inputs()
        output = run(inputs)
        loss_of(output).backward()
        grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        in_grads = [
            t.grad.clone()
            for t in pytree.tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.grad is not None
        ]
        results.append((output, grads, in_grads))
    (want, want_g, want_in), (got, got_g, got_in) = results
    assert pytree.tree_structure(got) == pytree.tree_structure(want)
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        if isinstance(w, torch.Tensor):
            assert rel_err(g, w) < 1e-6
        else:
            assert g == w
    assert set(got_g) == set(want_g) == set(params)
    assert_close(got_g, want_g, "parameter gradients")
    assert len(got_in) == len(want_in) > 0
    assert_close(dict(enumerate(got_in)), dict(enumerate(want_in)), "input gradients")


def stage_names(stages: list[nn.Module]) -> list[list[str]]:
    return [[n for n, _ in s.named_parameters()] for s in stages]


def assert_names_cover(model: nn.Module, stages: list[nn.Module], shared: int = 0) -> None:
    """Stage parameter names are original names; each parameter object is in exactly one
    stage except ``shared`` objects; and they are the model's objects, not copies."""
    original = dict(model.named_parameters(remove_duplicate=False))
    seen: dict[int, int] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert original[name] is p
            seen[id(p)] = seen.get(id(p), 0) + 1
    assert set(seen) == {id(p) for p in original.values()}
    assert sum(1 for c in seen.values() if c > 1) == shared


def inputs_with_grad(*shape: int, seed: int = 0) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).requires_grad_()

    return make


# ------------------------------------------------------------------ graph split


def test_skip_connection_is_relayed_across_two_stages() -> None:
    model = Skip()
    stages = split_model(model, 4)  # no annotations: balanced over the 4 equal Linears
    assert stage_names(stages) == [[f"blocks.{i}.weight", f"blocks.{i}.bias"] for i in range(4)]
    x = torch.randn(2, 8)
    out0 = stages[0](x)
    out1 = stages[1](out0)
    out2 = stages[2](out1)
    # h0 is relayed through stage 1, unchanged; the add follows its latest input into
    # stage 2, so only the sum goes on to stage 3.
    assert isinstance(out0, tuple) and len(out0) == 1
    assert isinstance(out1, tuple) and len(out1) == 2 and out1[0] is out0[0]
    assert isinstance(out2, tuple) and len(out2) == 1
    assert_same_as_model(model, stages, inputs_with_grad(2, 8))


def test_explicit_balance_counts_leaf_module_calls() -> None:
    model = Skip()
    stages = split_model(model, 2, [3, 1])
    assert stage_names(stages)[1] == ["blocks.3.weight", "blocks.3.bias"]
    assert_same_as_model(model, stages, inputs_with_grad(2, 8))
    with pytest.raises(ConfigError, match=r"4 layers .* add up to 4"):
        split_model(model, 2, [2, 1])


def test_pytree_and_int_constant_cross_the_boundary() -> None:
    model = Pytree()
    model.consume.pipeline_stage = 1
    stages = split_model(model, 2)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    sent = stages[0](x, y)
    assert isinstance(sent, tuple) and len(sent) == 2
    d, n = sent
    assert n == 6 and isinstance(n, int)
    assert set(d) == {"a", "pair"} and d["pair"][1] == 3
    assert isinstance(d["a"], torch.Tensor) and isinstance(d["pair"][0], torch.Tensor)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()

    assert_same_as_model(model, stages, make)
    out = chain(stages, (x, y))
    assert out[1]["n"] == 6
    # keyword inputs reach stage 0 as they reach the model
    kw = chain(stages, {"x": x, "y": y})
    assert rel_err(kw[0], model(x=x, y=y)[0]) < 1e-6


@pytest.mark.parametrize("style", ["attribute", "set_stage"])
def test_few_annotations_propagate_along_the_data(style: str) -> None:
    model = annotated_deep(style)
    assert stage_of(model.blocks[2]) == 1 and stage_of(model.blocks[1]) is None
    stages = split_model(model, 3)
    names = [sorted({n.rsplit(".", 1)[0] for n in s}) for s in stage_names(stages)]
    # stem, blocks 0-1 take stage 0 from the input; blocks 3 and 5, head follow their data
    assert names == [
        ["blocks.0.lin", "blocks.0.norm", "blocks.1.lin", "blocks.1.norm", "stem"],
        ["blocks.2.lin", "blocks.2.norm", "blocks.3.lin", "blocks.3.norm"],
        ["blocks.4.lin", "blocks.4.norm", "blocks.5.lin", "blocks.5.norm", "head"],
    ]
    assert_names_cover(model, stages)
    assert set(stages[1].state_dict()) | set(stages[0].state_dict()) | set(
        stages[2].state_dict()
    ) == set(model.state_dict())
    assert_same_as_model(model, stages, inputs_with_grad(5, 4))


def test_both_styles_give_the_same_split() -> None:
    a = split_model(annotated_deep("attribute"), 3)
    b = split_model(annotated_deep("set_stage"), 3)
    assert stage_names(a) == stage_names(b)
    assert [str(s.code) for s in a] == [str(s.code) for s in b]


def test_unannotated_graph_is_balanced_by_parameter_counts() -> None:
    model = Deep(blocks=4, width=8)
    stages = split_model(model, 2)
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    # stem 40, block 88 each, head 27: 40+88+88 = 216 | 88+88+27 = 203 is the best cut
    assert counts == [216, 203]
    assert_same_as_model(model, stages, inputs_with_grad(3, 4))


GPT_CUTS = {
    2: {"blocks.2": 1},
    3: {"blocks.1": 1, "blocks.3": 2},
    4: {"blocks.1": 1, "blocks.3": 2, "ln_f": 3},
}


@pytest.mark.parametrize("count", sorted(GPT_CUTS))
def test_tied_gpt_shares_the_embedding_with_the_head(count: int) -> None:
    model = TinyGPT()
    for name, stage in GPT_CUTS[count].items():
        set_stage(model.get_submodule(name), stage)
    stages = split_model(model, count)
    shared = shared_parameters(stages)
    assert shared == [("tok_emb.weight", [0, count - 1])]
    assert any(n == "lm_head.weight" for n, _ in stages[-1].named_parameters())
    assert_names_cover(model, stages, shared=1)
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(len(k) for k in keys) == len(model.state_dict())  # no key twice
    assert all("mask" not in k for ks in keys for k in ks)  # non-persistent stays so

    assert_same_as_model_no_input_grad(model, stages, tokens)


def assert_same_as_model_no_input_grad(
    model: nn.Module, stages: list[nn.Module], make: Callable[[], Any]
) -> None:
    """Like assert_same_as_model for integer inputs (token ids carry no gradient)."""
    model.zero_grad(set_to_none=True)
    want = model(make())
    loss_of(want).backward()
    want_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = chain(stages, make())
    loss_of(got).backward()
    got_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert rel_err(got, want) < 1e-6
    assert set(got_g) == set(want_g) == {n for n, _ in model.named_parameters()}
    assert_close(got_g, want_g, "parameter gradients")


def test_stages_share_weights_with_the_model() -> None:
    model = annotated_deep("attribute")
    stages = split_model(model, 3)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    assert stages[2].get_parameter("head.weight") is model.head.weight


class Extras(nn.Module):
    """An unused layer, and a constant tensor built from nothing inside forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + torch.ones(4)


def test_constants_are_built_where_used_and_unused_layers_are_kept() -> None:
    model = Extras()
    model.b.pipeline_stage = 1
    model.spare.pipeline_stage = 1
    stages = split_model(model, 2)
    sent = stages[0](torch.randn(2, 4))
    assert isinstance(sent, tuple) and len(sent) == 1  # torch.ones(4) is made on stage 1
    assert stage_names(stages) == [
        ["a.weight", "a.bias"],
        ["b.weight", "b.bias", "spare.weight", "spare.bias"],
    ]
    assert "_tensor_constant0" not in vars(model)  # tracing leaves the model as it was


# ------------------------------------------------------------------ layer lists


def test_sequential_annotated_on_children_is_cut_whole() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].pipeline_stage = 1
    stages = split_model(model, 2)
    assert [len(s) for s in stages] == [2, 3]
    assert_same_as_model(model, stages, inputs_with_grad(3, 4))


def test_sequential_annotated_inside_a_layer_is_split_as_a_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Block(8), nn.Linear(8, 2))
    model[1].lin.pipeline_stage = 1
    stages = split_model(model, 2)
    assert stage_names(stages) == [
        ["0.weight", "0.bias", "1.norm.weight", "1.norm.bias"],
        ["1.lin.weight", "1.lin.bias", "2.weight", "2.bias"],
    ]
    assert_same_as_model(model, stages, inputs_with_grad(3, 4))


# ------------------------------------------------------------------ execution sequences


def test_execution_sequence_runs_like_the_model_and_keeps_names() -> None:
    model = Net()
    seq = net_sequence(model)
    assert seq.names()[6] == "flatten"
    x = torch.randn(2, 1, 6, 6)
    assert rel_err(seq(x), model(x)) < 1e-6
    assert list(seq.state_dict()) == list(model.state_dict())
    stages = split_model(seq, 2)
    # min-max over parameter counts 40, 8, 0 | 148, 0, 74, 0, 219
    assert [s.names() for s in stages] == [
        ["conv1", "bn1", "relu", "layer1.0", "layer1.1", "layer2"],
        ["flatten", "fc"],
    ]
    assert [n for s in stage_names(stages) for n in s] == [n for n, _ in model.named_parameters()]
    assert list(stages[0].state_dict())[:3] == ["conv1.weight", "conv1.bias", "bn1.weight"]
    assert "layer1.0.weight" in stages[0].state_dict()
    model.eval()  # batch norm running statistics: the same in both runs
    assert_same_as_model(model, stages, inputs_with_grad(2, 1, 6, 6))


def test_execution_sequence_by_balance_and_by_annotation() -> None:
    model = Net()
    model.eval()
    stages = split_model(net_sequence(model), 3, [3, 3, 2])
    assert [s.names() for s in stages][2] == ["flatten", "fc"]
    assert_same_as_model(model, stages, inputs_with_grad(2, 1, 6, 6))
    model.layer1.pipeline_stage = 1  # covers steps layer1.0 and layer1.1
    stages = split_model(net_sequence(model), 2)
    assert [len(s.steps) for s in stages] == [3, 5]


def test_execution_sequence_errors() -> None:
    model = Net()
    with pytest.raises(ConfigError, match="no submodule 'layer9'"):
        sequence(model, ["conv1", "layer9"])
    with pytest.raises(ConfigError, match=r"'fc.weight', 'fc.bias'\] belong to no step"):
        sequence(model, ["conv1", "bn1", "layer1", "layer2"])


# ------------------------------------------------------------------ errors


def test_backward_annotation_names_the_module() -> None:
    model = Deep()
    model.blocks[1].pipeline_stage = 1
    model.blocks[2].pipeline_stage = 0
    with pytest.raises(
        ConfigError, match=r"blocks\.2 is annotated pipeline_stage=0 .* model\.blocks\.1,"
    ):
        split_model(model, 2)


def test_layer_list_annotations_are_checked_too() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    model[1].pipeline_stage = 1
    model[3].pipeline_stage = 0
    with pytest.raises(ConfigError, match=r"model\.3 is annotated pipeline_stage=0 .* model\.2"):
        split_model(model, 2)
    blocks = nn.ModuleList(Block(4) for _ in range(2))
    blocks[0].lin.pipeline_stage = 1
    blocks[0].norm.pipeline_stage = 0
    with pytest.raises(ConfigError, match=r"model\.0\.lin .* inside model\.0"):
        split_model(blocks, 2)


def test_empty_stage_names_the_stage() -> None:
    model = Deep()
    model.blocks[1].pipeline_stage = 1
    model.blocks[3].pipeline_stage = 3
    with pytest.raises(ConfigError, match="stage 2 is empty"):
        split_model(model, 4)


def test_annotation_stage_count_must_match_the_pipeline() -> None:
    model = Deep()
    model.blocks[1].pipeline_stage = 1
    model.blocks[3].pipeline_stage = 2
    with pytest.raises(ConfigError, match=r"make 3 stages .* needs 4 \(pp x chunks\)"):
        split_model(model, 4)


def test_annotations_and_balance_together_are_refused() -> None:
    model = Deep()
    model.blocks[3].pipeline_stage = 1
    with pytest.raises(ConfigError, match="annotations and a balance"):
        split_model(model, 2, [4, 4])


def test_untraceable_model_names_the_line_and_the_ways_out() -> None:
    model = Untraceable()
    # fx stops at the data-dependent branch: without a sample there is nothing to export
    with pytest.raises(ConfigError, match=r"cannot trace Untraceable .*zoo\.py:\d+\).* sample="):
        split_model(model, 2)
    # with one, torch.export stops at the same line; the error names it and the ways out
    with pytest.raises(
        ConfigError,
        match=r"cannot capture Untraceable .*torch\.export stopped .* at the model \(.*zoo\.py"
        r":\d+\).* nn\.Sequential .* execution sequence",
    ):
        split_model(model, 2, sample=torch.randn(3, 4))
    # the same model still splits through an execution sequence of its layers
    stages = split_model(sequence(model, ["a", "b"]), 2)
    assert stage_names(stages) == [["a.weight", "a.bias"], ["b.weight", "b.bias"]]
