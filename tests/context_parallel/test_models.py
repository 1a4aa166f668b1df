"""A transformers model's own forward and loss with its sequence cut over cp ranks (every
rank's share stacked in one process, as the pipeline feeds it): the unsplit model's loss
and gradients, packed documents and padded rows included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from conveyor.context_parallel import install, layout, op
from conveyor.context_parallel.rotation import Stacked
from tests.support.helpers import assert_close


def llama(kind: str = "llama") -> Any:
    import transformers as T

    common: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, **common))
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(sliding_window=6, **common))
    return T.LlamaForCausalLM(T.LlamaConfig(**common))


def cp_inputs(ids: Tensor, labels: Tensor, positions: Tensor, cp: int, key: int) -> dict[str, Any]:
    """What the pipeline gives a model under cp (every rank's share stacked on the rows)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]

    def share(t: Tensor) -> Tensor:
        return torch.cat([layout.cut(t, 1, cp, r) for r in range(cp)])

    doc = (torch.diff(positions, dim=1, prepend=positions[:, :1] - 1) != 1).cumsum(1)
    count = int((shifted != -100).sum())
    return {
        "input_ids": share(ids), "position_ids": share(positions), "labels": share(shifted),
        "shift_labels": share(shifted), "num_items_in_batch": count, install.KEY: key,
        install.DOC: doc,
    }  # fmt: skip


def compare(kind: str, cp: int, positions: Tensor, labels: Tensor | None = None) -> None:
    model = llama(kind)
    ids = torch.randint(0, 64, positions.shape, generator=torch.Generator().manual_seed(1))
    labels = ids.clone() if labels is None else labels
    want = model(input_ids=ids, labels=labels, position_ids=positions).loss
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    install.install(model)
    key = op.register(Stacked(cp))
    got = model(**cp_inputs(ids, labels, positions, cp, key)).loss
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert_close({n: p.grad for n, p in model.named_parameters()}, grads, f"{kind} cp {cp}")
    # outside the pipeline the model attends as it did (sdpa)
    again = model(input_ids=ids, labels=labels, position_ids=positions).loss
    assert float(again.detach()) == pytest.approx(float(want.detach()), rel=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_decoder_is_exact(kind: str, cp: int) -> None:
    compare(kind, cp, torch.arange(16).repeat(2, 1))


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_documents(cp: int) -> None:
    # DataCollatorWithFlattening's rows: positions restart per document, documents cross
    # chunk and rank boundaries
    rows = [[5, 3, 8], [11, 5]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    labels = torch.randint(0, 64, positions.shape)
    labels[positions == 0] = -100  # the first token of a document predicts nothing
    compare("llama", cp, positions, labels)


def test_padded_rows() -> None:
    positions = torch.arange(16).repeat(2, 1)
    labels = torch.randint(0, 64, (2, 16))
    labels[1, 10:] = -100
    compare("qwen3", 2, positions, labels)
